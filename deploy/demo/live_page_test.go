package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// pageView is a live view without connections to the system: its page and
// its API over a snapshot the test sets, with the compose controller on a
// recording runner, so a button's command is recorded and nothing runs.
type pageView struct {
	v   *liveView
	run *fakeRunner
	out *syncBuffer // the demo's terminal
}

func newPageView(t *testing.T, cfg config) *pageView {
	t.Helper()
	tmpl, err := parsePage()
	if err != nil {
		t.Fatal(err)
	}
	out := &syncBuffer{}
	run := &fakeRunner{}
	d := newDemo(cfg, out)
	d.ctl = newComposeController(run, testComposeFile)
	return &pageView{
		v:   &liveView{d: d, ctl: d.ctl, page: tmpl, done: make(chan struct{}), last: map[string]procStatus{}},
		run: run, out: out,
	}
}

func (p *pageView) setSnapshot(s snapshot) {
	p.v.mu.Lock()
	defer p.v.mu.Unlock()
	p.v.snap = s
}

// A POST to an action from another origin (a page elsewhere that the
// user's browser runs) is refused with 403 and does nothing; the page's own
// requests, and requests without a browser's headers (curl), go through.
// The requests are real HTTP requests carrying the headers browsers send.
func TestActionsRefuseCrossOriginRequests(t *testing.T) {
	t.Parallel()
	p := newPageView(t, config{})
	p.setSnapshot(snapshot{At: time.Now()})
	srv := httptest.NewServer(p.v.routes())
	t.Cleanup(srv.Close)
	for _, c := range []struct {
		name    string
		headers map[string]string
		refused bool
	}{
		{"the live view's own page", map[string]string{"Sec-Fetch-Site": "same-origin", "Origin": srv.URL}, false},
		{"curl: no browser headers", nil, false},
		{"a browser without Sec-Fetch-Site, same origin", map[string]string{"Origin": srv.URL}, false},
		{"a page on another site", map[string]string{"Sec-Fetch-Site": "cross-site", "Origin": "https://attacker.example"}, true},
		{"a page on another port of this host", map[string]string{"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:1"}, true},
		{"a sandboxed frame", map[string]string{"Sec-Fetch-Site": "cross-site", "Origin": "null"}, true},
		{"a browser without Sec-Fetch-Site, another origin", map[string]string{"Origin": "https://attacker.example"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			p.run.mu.Lock()
			p.run.ran = nil
			p.run.mu.Unlock()
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/api/actions/stop-relays", nil)
			for k, v := range c.headers {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			ran := p.run.lines()
			if c.refused {
				var e struct {
					Error struct{ Code string } `json:"error"`
				}
				if resp.StatusCode != http.StatusForbidden || json.Unmarshal(body, &e) != nil || e.Error.Code != "cross_origin" {
					t.Errorf("got %s %s, want 403 with a JSON error cross_origin", resp.Status, body)
				}
				if len(ran) != 0 {
					t.Errorf("a refused request still ran %q", ran)
				}
				return
			}
			if resp.StatusCode != http.StatusOK || len(ran) != 1 || !strings.HasSuffix(ran[0], " stop relay") {
				t.Errorf("got %s %s and ran %q, want 200 and docker compose stop relay", resp.Status, body, ran)
			}
		})
	}
	if !strings.Contains(p.out.String(), `refused a cross-origin POST /api/actions/stop-relays (Origin "https://attacker.example"`) {
		t.Errorf("the terminal does not say a request was refused:\n%s", p.out)
	}
	// Reading is not an action: the browser itself keeps another site from
	// reading the answer.
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/api/state", nil)
	req.Header.Set("Sec-Fetch-Site", "cross-site")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /api/state from another site: %s, want 200", resp.Status)
	}
}

// The page and the banners show every URL without its password, MongoDB's
// too.
func TestLiveViewRedactsPasswords(t *testing.T) {
	cfg := config{
		DatabaseURL: "postgres://orders:pg-secret@db:5432/orders",
		AMQPURL:     "amqp://guest:mq-secret@mq:5672/",
		MongoURI:    "mongodb://shipping:mongo-secret@mongo:27017/shipping?authSource=admin",
		UIAddr:      "127.0.0.1:8090", OrdersAddr: "o:1", ShippingAddr: "s:1",
	}
	p := newPageView(t, cfg)
	rec := httptest.NewRecorder()
	p.v.routes().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	p.v.d.banner()
	p.v.d.composeBanner(p.v.ctl.(*composeController))
	for what, text := range map[string]string{"the page": rec.Body.String(), "the banners": p.out.String()} {
		for _, secret := range []string{"pg-secret", "mq-secret", "mongo-secret"} {
			if strings.Contains(text, secret) {
				t.Errorf("%s shows the password %s", what, secret)
			}
		}
		if !strings.Contains(text, "mongodb://shipping:xxxxx@mongo:27017/shipping") {
			t.Errorf("%s does not show MongoDB's redacted URI", what)
		}
	}
}

func TestRedacted(t *testing.T) {
	for raw, want := range map[string]string{
		"mongodb://u:secret@h:27017/db":              "mongodb://u:xxxxx@h:27017/db",
		"mongodb://u:secret@a:1,b:2/db?replicaSet=r": "mongodb://u:xxxxx@a:1,b:2/db?replicaSet=r",
		"mongodb://u:sec%ret@h/db":                   "mongodb://u:xxxxx@h/db", // does not parse
		"mongodb://u:sec%ret@h":                      "mongodb://u:xxxxx@h",
		"mongodb://u@h/db":                           "mongodb://u@h/db",
		"mongodb://h:27017/db":                       "mongodb://h:27017/db",
		"postgres://p:secret@h/db?sslmode=disable":   "postgres://p:xxxxx@h/db?sslmode=disable",
		"amqp://guest:guest@127.0.0.1:5672/":         "amqp://guest:xxxxx@127.0.0.1:5672/",
		"not a url %":                                "not a url %",
	} {
		if got := redacted(raw); got != want {
			t.Errorf("redacted(%q) = %q, want %q", raw, got, want)
		}
	}
}

package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
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
		JaegerUI:    "http://127.0.0.1:16686",
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
	if !strings.Contains(rec.Body.String(), "http://127.0.0.1:16686") {
		t.Error("the page does not say where Jaeger is")
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

func TestTraceID(t *testing.T) {
	for tp, want := range map[string]string{
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01":        "4bf92f3577b34da6a3ce929d0e0e4736",
		"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-future": "4bf92f3577b34da6a3ce929d0e0e4736",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x":      "",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01":        "",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01":        "",
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01":        "",
		"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01":        "",
		"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01":         "",
		"": "",
	} {
		if got := traceID(tp); got != want {
			t.Errorf("traceID(%q) = %q, want %q", tp, got, want)
		}
	}
}

func ptr[T any](v T) *T { return &v }

// The page tells the truth about what it knows, in a real browser, over
// snapshots the test sets: a count that could not be read says "unknown"
// (pending with PostgreSQL unreadable is not "none waiting"); a dead letter
// that shipping recorded and published to the dead-letter queue counts once;
// a state shown by a colour is also said in words; a failed /api/state
// shows a banner and the numbers it keeps are marked stale after a few
// seconds, as are numbers the demo read long ago; and axe-core finds no
// serious or critical accessibility violation in any of these states.
func TestLivePageTellsTheTruth(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a browser")
	}
	t.Parallel()
	chromium := chromiumPath(t)
	p := newPageView(t, config{})
	var mode atomic.Value // of string: "fresh", "old" or "fail"
	mode.Store("fresh")
	routes := p.v.routes()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/api/state" {
			switch mode.Load() {
			case "fail":
				writeError(w, http.StatusInternalServerError, "boom", "the test fails /api/state")
				return
			case "fresh":
				p.v.mu.Lock()
				p.v.snap.At = time.Now()
				p.v.mu.Unlock()
			case "old":
				p.v.mu.Lock()
				p.v.snap.At = time.Now().Add(-30 * time.Second)
				p.v.mu.Unlock()
			}
		}
		routes.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)

	running := func(name string, ready bool) processView {
		return processView{procStatus: procStatus{Name: name, State: procRunning}, Ready: &ready}
	}
	// PostgreSQL unreadable: its counts are unknown. Shipping dead-lettered
	// one message: its record in MongoDB and its copy in the dead-letter
	// queue are one dead letter.
	p.setSnapshot(snapshot{
		Stages: stages{
			Published: nil, QueueReady: ptr[int64](0), QueueConsumers: ptr[int64](1), DelayQueue: ptr[int64](0),
			DeadLetterQueue: ptr[int64](1), Applied: ptr[int64](3), ShippingDead: ptr[int64](1), ParkedAggregates: ptr[int64](2),
			deliveryCounts: deliveryCounts{Delivered: 3, Applied: 3},
		},
		Processes: []processView{running("orders", true), running("relay", false), {procStatus: procStatus{Name: "shipping", State: procStopped}}},
		Errors:    map[string]string{"postgres": "connection refused", "audit": "not answering: connection refused"},
	})
	ctx := browser(t, chromium)
	problems := watchConsole(t, ctx)
	pg := page{t: t, ctx: ctx, js: problems}
	pg.run("open the page", chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(chromedp.ID("stage-created")))
	pg.waitUntil("the first reading", func() bool { return pg.eval(`document.getElementById("status-line").dataset.at`) != "" })

	text := func(sel string) string {
		t.Helper()
		return pg.eval(`document.querySelector(` + jsString(sel) + `).textContent`)
	}
	for sel, want := range map[string]string{
		"#stage-created .count":   "unknown",
		"#stage-pending .count":   "unknown",
		"#oldest-age":             "oldest: unknown",
		"#stage-published .count": "unknown",
		"#events-written":         "unknown",
		"#stage-dead .count":      "unknown", // the outbox's are unknown
	} {
		if got := text(sel); got != want {
			t.Errorf("with PostgreSQL unreadable, %s shows %q, want %q", sel, got, want)
		}
	}
	if got := pg.eval(`document.getElementById("stage-applied").className`); strings.Contains(got, "good") {
		t.Errorf("applied is shown caught up (%q) while events written is unknown", got)
	}
	if got := text("#status-line"); !strings.Contains(got, "cannot read ") || !strings.Contains(got, "postgres: connection refused") {
		t.Errorf("status line %q does not say PostgreSQL cannot be read", got)
	}
	if got := text("#proc-relay .badge"); got != "up, not ready" {
		t.Errorf("relay badge %q", got)
	}
	// The audit cannot be read: its result is unknown, not whole, not 0.
	if got := text("#audit-verdict"); !strings.Contains(got, "Result unknown: cannot read the audit") {
		t.Errorf("audit verdict with the audit unreadable: %q", got)
	}
	for _, b := range []string{"checked", "applied", "missing", "phantom"} {
		if got := text("#audit-" + b + " dd"); got != "unknown" {
			t.Errorf("audit %s shows %q with the audit unreadable, want unknown", b, got)
		}
	}
	axeCheck(t, pg, "counts unknown")

	// The audit's last report, as cmd/audit serves it: two events missing,
	// one phantom.
	notWhole, err := decodeAudit([]byte(`{"since":"2026-01-01T00:00:00Z","until":"2026-01-08T00:00:00Z","grace":"1m0s",
		"audited_at":"2026-01-08T00:00:01Z","duration_seconds":0.25,"checked":10,
		"applied":{"count":6,"examples":[]},"unrecorded":{"count":0,"examples":[]},"missing":{"count":2,"examples":["17","21"]},
		"phantom":{"count":1,"examples":["987654321"]},"pending":{"count":1,"examples":["30"]},"dead_lettered":{"count":1,"examples":["5"]},
		"discarded":{"count":0,"examples":[]},"held":{"count":0,"examples":[]},"inbox_records":7}`))
	if err != nil || notWhole.Whole {
		t.Fatalf("decode a report with missing events: %+v, %v", notWhole, err)
	}
	// Everything known, every state on: pending stuck, a queue backlog,
	// duplicates absorbed, one dead letter.
	p.setSnapshot(snapshot{
		Stages: stages{
			OrdersCreated: ptr[int64](9), EventsWritten: ptr[int64](10), Pending: ptr[int64](4), OldestPendingAge: ptr(12.5),
			OutboxDeadLetters: ptr[int64](0), Published: ptr[int64](6), Discarded: ptr[int64](0),
			QueueReady: ptr[int64](3), QueueConsumers: ptr[int64](1), DelayQueue: ptr[int64](0), DeadLetterQueue: ptr[int64](1),
			Applied: ptr[int64](2), ShippingDead: ptr[int64](1), ParkedAggregates: ptr[int64](0),
			deliveryCounts: deliveryCounts{Delivered: 5, Applied: 2, DuplicatesInbox: 1, DuplicatesVersion: 1},
		},
		Processes: []processView{running("orders", true), {procStatus: procStatus{Name: "relay", State: procRestarting}}, {procStatus: procStatus{Name: "shipping", State: procExited, LastExit: "exit status 2"}}},
		Audit:     notWhole,
		Errors:    map[string]string{},
	})
	pg.waitUntil("the second reading", func() bool { return text("#stage-pending .count") == "4" })
	for sel, want := range map[string]string{
		"#stage-dead .count":       "1",
		"#stage-dead .sub":         "outbox 0, dead-letter queue 1; shipping keeps 1 for replay",
		"#stage-duplicates .count": "2",
		"#oldest-age":              "oldest 12.5 s",
	} {
		if got := text(sel); got != want {
			t.Errorf("%s shows %q, want %q", sel, got, want)
		}
	}
	// Not by colour alone: each coloured stage says its state in words.
	colouredWithoutWords := pg.eval(`[...document.querySelectorAll(".stage.hot, .stage.bad, .stage.good")]` +
		`.filter(s => !(s.querySelector(".flag")?.textContent || "").trim()).map(s => s.id).join(" ") || "none"`)
	coloured := pg.eval(`document.querySelectorAll(".stage.hot, .stage.bad, .stage.good").length`)
	if colouredWithoutWords != "none" || coloured != "4" {
		t.Errorf("coloured stages: %s; without words: %s (want 4: pending, queue, duplicates, dead letters; none without words)", coloured, colouredWithoutWords)
	}
	if got := pg.eval(`document.body.dataset.stale`); got != "false" {
		t.Errorf("fresh numbers marked stale: %s", got)
	}
	// The audit's alarm: in words, with the ids, announced (role alert);
	// the two buckets that break the flow marked.
	if got := text("#audit-alarm"); got != "Alarm: the flow is not whole: 2 event(s) committed and never applied (missing: 17, 21); "+
		"1 inbox record(s) of events never committed (phantom: 987654321)." {
		t.Errorf("audit alarm %q", got)
	}
	if got := pg.eval(`document.getElementById("audit-alarm").hidden`); got != "false" {
		t.Errorf("audit alarm hidden=%s with 2 missing and 1 phantom", got)
	}
	for b, want := range map[string]string{"checked": "10", "applied": "6", "missing": "2", "phantom": "1", "pending": "1", "dead_lettered": "1", "discarded": "0"} {
		if got := text("#audit-" + b + " dd"); got != want {
			t.Errorf("audit %s shows %q, want %s", b, got, want)
		}
	}
	if got := pg.eval(`[...document.querySelectorAll("#audit-buckets div.bad")].map(d => d.id).join(" ")`); got != "audit-missing audit-phantom" {
		t.Errorf("audit buckets marked bad: %q, want missing and phantom", got)
	}
	if got := text("#audit-when"); !strings.HasPrefix(got, "Last audit ran at 00:00:01.000 UTC") || !strings.Contains(got, "in 0.250 s; it judged the events created from 2026-01-01 00:00:00 to 2026-01-08 00:00:00 UTC; 7 inbox records read") {
		t.Errorf("audit time: %q", got)
	}
	axeCheck(t, pg, "every stage state, the audit's alarm")

	// Nothing missing, one phantom: the flow is not whole either.
	phantomOnly, err := decodeAudit([]byte(`{"since":"2026-01-01T00:00:00Z","until":"2026-01-08T00:00:00Z","grace":"1m0s",
		"audited_at":"2026-01-08T00:00:02Z","duration_seconds":0.5,"checked":3,
		"applied":{"count":3,"examples":[]},"unrecorded":{"count":0,"examples":[]},"missing":{"count":0,"examples":[]},
		"phantom":{"count":1,"examples":["987654321"]},"pending":{"count":0,"examples":[]},"dead_lettered":{"count":0,"examples":[]},
		"discarded":{"count":0,"examples":[]},"held":{"count":0,"examples":[]},"inbox_records":4}`))
	if err != nil {
		t.Fatal(err)
	}
	p.v.mu.Lock()
	p.v.snap.Audit = phantomOnly
	p.v.mu.Unlock()
	pg.waitUntil("the audit with one phantom", func() bool { return text("#audit-checked dd") == "3" })
	if got := text("#audit-alarm"); got != "Alarm: the flow is not whole: 1 inbox record(s) of events never committed (phantom: 987654321)." {
		t.Errorf("audit alarm with a phantom only: %q", got)
	}
	if got := text("#audit-verdict"); got != "⚠ NOT WHOLE: 0 missing, 1 phantom." {
		t.Errorf("audit verdict with a phantom only: %q", got)
	}

	// /api/state fails: a banner says so at once; the numbers stay, and are
	// marked stale once they are older than a few seconds.
	mode.Store("fail")
	pg.waitUntil("the error banner", func() bool { return pg.eval(`document.getElementById("banner").hidden`) == "false" })
	if got := text("#banner"); !strings.Contains(got, "Cannot read the demo's state") || !strings.Contains(got, "HTTP 500") {
		t.Errorf("banner: %q", got)
	}
	if got := pg.eval(`document.getElementById("banner").getAttribute("role")`); got != "alert" {
		t.Errorf("the banner's role is %q, want alert", got)
	}
	pg.waitUntil("the kept numbers marked stale", func() bool { return pg.eval(`document.body.dataset.stale`) == "true" })
	if got := text("#stale-note"); !strings.HasPrefix(got, "Stale: the numbers below were read at ") {
		t.Errorf("stale note: %q", got)
	}
	if got := text("#stage-pending .count"); got != "4" {
		t.Errorf("pending shows %q while /api/state fails, want the last reading, 4, marked stale", got)
	}
	axeCheck(t, pg, "banner and stale numbers")

	// /api/state answers again: the banner goes, and so does the stale mark.
	mode.Store("fresh")
	pg.waitUntil("the banner gone and the numbers fresh", func() bool {
		return pg.eval(`document.getElementById("banner").hidden`) == "true" && pg.eval(`document.body.dataset.stale`) == "false"
	})
	// The demo answers, but its reading is 30 s old (a source held it).
	mode.Store("old")
	pg.waitUntil("an old reading marked stale", func() bool { return pg.eval(`document.body.dataset.stale`) == "true" })
	if got := text("#stale-note"); !strings.Contains(got, " 30 s ago") && !strings.Contains(got, " 31 s ago") {
		t.Errorf("stale note for a reading 30 s old: %q", got)
	}
	problems.check()
}

// jsString quotes s for a JavaScript expression.
func jsString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

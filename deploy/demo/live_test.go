package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// chromiumPath finds the browser: CHROMIUM if set, else chromium on the PATH.
func chromiumPath(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("CHROMIUM"); p != "" {
		if _, err := exec.LookPath(p); err != nil {
			skipOrFail(t, "CHROMIUM=%s: %v", p, err)
		}
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	skipOrFail(t, "no chromium on the PATH (Debian: apt-get install chromium; .ci/run installs it)")
	return ""
}

// browser starts a headless Chromium of the test's own. The flags keep it
// from reaching for the network at start (updates, sync, QUIC probes): on a
// machine without one, it would stall.
func browser(t *testing.T, path string) context.Context {
	t.Helper()
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(path),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 1700),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(actx)
	t.Cleanup(func() {
		_ = chromedp.Cancel(ctx)
		cancelCtx()
		cancelAlloc()
	})
	// Start the browser now, with a bound, so a browser that cannot start
	// fails here and says so.
	// (The first Run starts it; its context must not carry a timeout, which
	// would stop the browser: the bound is a watchdog instead.)
	watchdog := time.AfterFunc(2*time.Minute, cancelCtx)
	defer watchdog.Stop()
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	return ctx
}

// page drives the live view in the browser.
type page struct {
	t   *testing.T
	ctx context.Context
}

func (p page) run(what string, steps ...chromedp.Action[chromedp.Void]) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		p.t.Fatalf("%s: %v", what, err)
	}
}

func (p page) click(action string) {
	p.t.Helper()
	p.run("click "+action, chromedp.Click(chromedp.CSS(`#action-`+action+` button`)))
}

// eval returns a JavaScript expression's string value.
func (p page) eval(expr string) string {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`String(`+expr+`)`))
	if err != nil {
		p.t.Fatalf("evaluate %s: %v", expr, err)
	}
	return s
}

// stage is a pipeline stage's count as the page shows it (-1: unknown).
func (p page) stage(id string) int64 {
	p.t.Helper()
	n, err := strconv.ParseInt(p.eval(`document.getElementById("stage-`+id+`").dataset.count`), 10, 64)
	if err != nil {
		return -1
	}
	return n
}

func (p page) oldestAge() float64 {
	p.t.Helper()
	f, _ := strconv.ParseFloat(p.eval(`document.getElementById("oldest-age").dataset.seconds`), 64)
	return f
}

func (p page) journey() string {
	p.t.Helper()
	return p.eval(`document.getElementById("journey").innerText`)
}

// waitUntil polls the page until cond holds; the deadline is generous (a
// loaded machine), and on failure the message shows the page's state.
func (p page) waitUntil(what string, cond func() bool) {
	p.t.Helper()
	defer func(start time.Time) { p.t.Logf("%s: %s", what, time.Since(start).Round(time.Millisecond)) }(time.Now())
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			p.t.Fatalf("the page never showed %s; pipeline: %s; journey: %s", what,
				p.eval(`document.getElementById("pipeline").innerText.replace(/\s+/g, " ")`), p.journey())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (p page) screenshot(path string) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		p.t.Fatalf("screenshot: %v", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		p.t.Fatal(err)
	}
	if err := os.WriteFile(path, png, 0o644); err != nil {
		p.t.Fatal(err)
	}
	p.t.Logf("screenshot: %s", path)
}

// artifactPath is where the test leaves its screenshot: $ARTIFACTS_DIR, or
// testdata/artifacts (ignored by git).
func artifactPath(name string) string {
	if dir := os.Getenv("ARTIFACTS_DIR"); dir != "" {
		return filepath.Join(dir, name)
	}
	abs, err := filepath.Abs(filepath.Join("testdata", "artifacts", name))
	if err != nil {
		return filepath.Join("testdata", "artifacts", name)
	}
	return abs
}

// state reads the live view's /api/state as the page does.
func state(t *testing.T, base string) snapshot {
	t.Helper()
	resp, err := http.Get(base + "/api/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var s snapshot
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		t.Fatalf("GET /api/state: %v", err)
	}
	return s
}

// The live view in a real browser, on the real system: an order placed with
// a click reaches "applied once"; with both relays stopped from the page,
// the next order stays pending (1) with a growing oldest age while the API
// still takes it; started again, the relays drain it, and the applied count
// matches the orders placed. LIVE_VIEW_SCREENSHOT=path also saves the
// screenshot there (docs/demo-live.png was taken so).
func TestLiveViewInABrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs every service and a browser")
	}
	chromium := chromiumPath(t)
	dbURL := demoDatabase(t)
	amqpURL := demoVhost(t)
	start := time.Now()
	ctx := browser(t, chromium)
	t.Logf("browser started: %s", time.Since(start).Round(time.Millisecond))
	bin := buildBinaries(t)
	t.Logf("binaries built: %s", time.Since(start).Round(time.Millisecond))
	state := t.TempDir()
	orders, shipping, relay, relay2, ui, mongo := freePort(t), freePort(t), freePort(t), freePort(t), freePort(t), freePort(t)
	args := []string{"-bin", bin, "-state", state, "-orders-addr", orders, "-shipping-addr", shipping,
		"-relay-addr", relay, "-relay2-addr", relay2, "-ui-addr", ui}
	env := map[string]string{"DATABASE_URL": dbURL, "AMQP_URL": amqpURL, "MONGO_URI": "mongodb://" + mongo + "/shipping"}
	d := startDemo(t, args, env)
	t.Logf("demo up: %s", time.Since(start).Round(time.Millisecond))
	base := "http://" + ui

	p := page{t: t, ctx: ctx}
	p.run("open the live view", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.ID("stage-created")))
	p.waitUntil("the first reading", func() bool { return p.stage("created") == 0 && p.stage("applied") == 0 })

	// 1. One order, from the page, all the way.
	p.click("place-order")
	p.waitUntil("the order applied once", func() bool {
		j := p.journey()
		return strings.Contains(j, "order.created v1") && strings.Contains(j, "applied once") && strings.Contains(j, "delivered 1×")
	})
	p.waitUntil("one order created and applied", func() bool {
		return p.stage("created") == 1 && p.stage("applied") == 1 && p.stage("pending") == 0
	})

	// 2. No relay: the order is taken, its event waits.
	p.click("stop-relays")
	p.waitUntil("both relays down", func() bool {
		return p.eval(`document.getElementById("proc-relay-1").dataset.state`) == procStopped &&
			p.eval(`document.getElementById("proc-relay-2").dataset.state`) == procStopped
	})
	p.click("place-order")
	p.waitUntil("the second order created, its event pending", func() bool {
		return p.stage("created") == 2 && p.stage("pending") == 1 && p.oldestAge() > 0
	})
	first := p.oldestAge()
	p.waitUntil("the oldest pending age growing", func() bool { return p.oldestAge() > first })
	if n := p.stage("applied"); n != 1 {
		t.Fatalf("with both relays stopped, applied = %d, want 1", n)
	}
	if j := p.journey(); !strings.Contains(j, "pending") || !strings.Contains(j, "not applied yet") {
		t.Fatalf("the journey of the held order does not say it waits:\n%s", j)
	}

	// 3. The relays come back; the outbox drains; nothing lost, nothing twice.
	p.click("start-relays")
	p.waitUntil("pending back to 0 and both orders applied", func() bool {
		return p.stage("pending") == 0 && p.stage("applied") == 2 && p.stage("created") == 2 && p.stage("published") == 2
	})
	p.waitUntil("the second order applied once", func() bool { return strings.Contains(p.journey(), "applied once") })
	if n := p.stage("duplicates"); n != 0 {
		t.Errorf("duplicates absorbed = %d after a clean run, want 0", n)
	}
	p.screenshot(artifactPath("demo-live-view.png"))
	if path := os.Getenv("LIVE_VIEW_SCREENSHOT"); path != "" {
		p.screenshot(path)
	}

	// The page's API refuses what it does not know, with JSON errors.
	for _, c := range []struct {
		method, path string
		want         int
	}{
		{http.MethodGet, "/api/journey?order=nope", http.StatusBadRequest},
		{http.MethodGet, "/api/journey?order=00000000-0000-0000-0000-000000000000", http.StatusNotFound},
		{http.MethodPost, "/api/actions/no-such-action", http.StatusNotFound},
		{http.MethodPost, "/api/actions/stop?process=orders", http.StatusBadRequest},
		{http.MethodPost, "/api/actions/cancel-order", http.StatusBadRequest},
		{http.MethodGet, "/api/actions/place-order", http.StatusMethodNotAllowed},
		{http.MethodGet, "/nothing-here", http.StatusNotFound},
	} {
		req, _ := http.NewRequest(c.method, base+c.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", c.method, c.path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var e struct {
			Error struct{ Code, Message string } `json:"error"`
		}
		jsonErr := json.Unmarshal(body, &e)
		if resp.StatusCode != c.want || jsonErr != nil || e.Error.Code == "" {
			t.Errorf("%s %s: %s %s, want %d with a JSON error", c.method, c.path, resp.Status, body, c.want)
		}
	}
	d.stop(t)
}

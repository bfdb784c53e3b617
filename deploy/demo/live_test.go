package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	mongodriver "go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
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
	js  *jsProblems // when set, a wait fails as soon as the page's script does
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

// clickForOrder clicks a button that places an order and waits until the
// journey follows that new order; it returns the order's id.
func (p page) clickForOrder(action string) string {
	p.t.Helper()
	before := p.followed()
	p.click(action)
	var id string
	p.waitUntil("the journey following the order "+action+" placed", func() bool {
		id = p.followed()
		return id != "" && id != before && strings.Contains(p.eval(`document.getElementById("journey-head").textContent`), id)
	})
	return id
}

// followed is the id of the order the journey follows.
func (p page) followed() string {
	p.t.Helper()
	return p.eval(`document.getElementById("follow-id").value`)
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

// auditCount is a loss audit bucket's count as the page shows it (-1:
// unknown).
func (p page) auditCount(bucket string) int64 {
	p.t.Helper()
	n, err := strconv.ParseInt(p.eval(`document.getElementById("audit-`+bucket+`").dataset.count`), 10, 64)
	if err != nil {
		return -1
	}
	return n
}

// auditState is the audit panel's state: whole, not-whole, waiting,
// unknown or none.
func (p page) auditState() string {
	p.t.Helper()
	return p.eval(`document.getElementById("audit").dataset.state`)
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
		if p.js != nil && p.js.any() {
			p.js.check()
			p.t.FailNow()
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("the page never showed %s; pipeline: %s; journey: %s", what,
				p.eval(`document.getElementById("pipeline").innerText.replace(/\s+/g, " ")`), p.journey())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// screenshot saves the whole page, or with viewport only what the window
// shows (its top).
func (p page) screenshot(path string, viewport bool) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	defer cancel()
	shot := chromedp.FullScreenshot(100)
	if viewport {
		shot = chromedp.CaptureScreenshot()
	}
	png, err := chromedp.Run(ctx, shot)
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

// jsProblems collects what the page's script got wrong, from the browser's
// console: uncaught exceptions and unhandled rejections, console.error calls,
// and the browser's own error entries except failed HTTP requests (the
// tests make some fail on purpose, and the browser logs each one).
type jsProblems struct {
	t    *testing.T
	mu   sync.Mutex
	list []string
}

// watchConsole starts collecting from the browser's current tab; it stops
// when the test ends.
func watchConsole(t *testing.T, ctx context.Context) *jsProblems {
	t.Helper()
	lctx, cancel := context.WithCancel(ctx)
	msgs := chromedp.Console(lctx) // subscribed from here on
	w := &jsProblems{t: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m, err := range msgs {
			if err != nil {
				return
			}
			if m.IsException() || (m.Type == chromedp.ConsoleError && m.Source != "network") || m.Type == "assert" {
				w.mu.Lock()
				w.list = append(w.list, fmt.Sprintf("%s (%s:%d)", m, m.URL, m.Line+1))
				w.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return w
}

func (w *jsProblems) any() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.list) > 0
}

// check fails the test if the page's script failed.
func (w *jsProblems) check() {
	w.t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.list) > 0 {
		w.t.Errorf("the page's JavaScript failed:\n  %s", strings.Join(w.list, "\n  "))
	}
}

// axeSource is axe-core's script (testdata/axe-core/README.md).
var axeSource = sync.OnceValues(func() ([]byte, error) {
	return os.ReadFile(filepath.Join("testdata", "axe-core", "axe.min.js"))
})

type axeViolation struct {
	ID     string   `json:"id"`
	Impact string   `json:"impact"`
	Help   string   `json:"help"`
	Nodes  []string `json:"nodes"`
}

// axeCheck runs axe-core on the page as it is and fails the test on any
// violation of impact serious or critical (colour contrast among them).
func axeCheck(t *testing.T, p page, when string) {
	t.Helper()
	began := time.Now()
	src, err := axeSource()
	if err != nil {
		t.Fatalf("axe-core: %v", err)
	}
	ctx, cancel := context.WithTimeout(p.ctx, time.Minute)
	defer cancel()
	if _, err := chromedp.Run(ctx, chromedp.Evaluate[chromedp.Void](string(src))); err != nil {
		t.Fatalf("inject axe-core: %v", err)
	}
	all, err := chromedp.Run(ctx, chromedp.Evaluate[[]axeViolation](`axe.run(document, {resultTypes: ["violations"]}).then(r => r.violations.map(v => ({
		id: v.id, impact: v.impact || "", help: v.help,
		nodes: v.nodes.map(n => n.target.join(" ") + ": " + (n.failureSummary || "").replace(/\s+/g, " "))})))`, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatalf("axe-core run: %v", err)
	}
	var bad, other []string
	for _, v := range all {
		line := fmt.Sprintf("%s (%s): %s\n      %s", v.ID, v.Impact, v.Help, strings.Join(v.Nodes, "\n      "))
		if v.Impact == "serious" || v.Impact == "critical" {
			bad = append(bad, line)
		} else {
			other = append(other, v.ID+" ("+v.Impact+")")
		}
	}
	if len(bad) > 0 {
		t.Errorf("axe-core, %s: %d serious or critical violations:\n  %s", when, len(bad), strings.Join(bad, "\n  "))
		return
	}
	t.Logf("axe-core, %s: no serious or critical violation (others: %v; %s)", when, other, time.Since(began).Round(time.Millisecond))
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

func processByName(s snapshot, name string) processView {
	for _, p := range s.Processes {
		if p.Name == name {
			return p
		}
	}
	return processView{}
}

// The live view in a real browser, on the real system, with tracing on:
//
//  1. an order placed with a click reaches "applied once", and its journey
//     shows the trace id stored with its event, linked to JAEGER_UI;
//  2. with both relays stopped from the page, the next order stays pending
//     with a growing oldest age while the API still takes it; a message id
//     selected in the journey stays selected while its row updates and the
//     relays, started again, drain the outbox;
//  3. a page on another origin that posts "stop both relays" is refused and
//     stops nothing;
//  4. the crash buttons kill relay-1 between its publish and its mark, then
//     shipping between its effect and its ack: each order is delivered
//     twice, the duplicate is absorbed, and applied = orders created;
//  5. axe-core finds no serious or critical violation, and the page's
//     script never fails.
//
// LIVE_VIEW_SCREENSHOT=path also saves a screenshot of the window there
// after the relay crash (docs/demo-live.png was taken so).
func TestLiveViewInABrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs every service and a browser")
	}
	chromium := chromiumPath(t)
	dbURL := demoDatabase(t)
	amqpURL := demoVhost(t)
	// The processes inherit the test's environment. Tracing on, exported
	// to a sink of the test's own (its spans are not looked at: the
	// journey reads the trace context stored with each event).
	sink := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
	}))
	t.Cleanup(sink.Close)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.URL)
	// A relay killed between publish and mark holds its row until its lease
	// ends (30 s by default): a shorter lease keeps the test short.
	t.Setenv("RELAY_LEASE", "9s")
	start := time.Now()
	ctx := browser(t, chromium)
	t.Logf("browser started: %s", time.Since(start).Round(time.Millisecond))
	bin := buildBinaries(t)
	t.Logf("binaries built: %s", time.Since(start).Round(time.Millisecond))
	state0 := t.TempDir()
	ports := freePorts(t, 7)
	orders, shipping, relay, relay2, ui, mongo, audit := ports[0], ports[1], ports[2], ports[3], ports[4], ports[5], ports[6]
	args := []string{"-bin", bin, "-state", state0, "-orders-addr", orders, "-shipping-addr", shipping,
		"-relay-addr", relay, "-relay2-addr", relay2, "-ui-addr", ui, "-audit-addr", audit}
	const jaeger = "http://jaeger.test:16686"
	env := map[string]string{"DATABASE_URL": dbURL, "AMQP_URL": amqpURL, "MONGO_URI": "mongodb://" + mongo + "/shipping", "JAEGER_UI": jaeger}
	d := startDemo(t, args, env)
	t.Logf("demo up: %s", time.Since(start).Round(time.Millisecond))
	base := "http://" + ui

	js := watchConsole(t, ctx)
	p := page{t: t, ctx: ctx, js: js}
	p.run("open the live view", chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.ID("stage-created")))
	p.waitUntil("the first reading", func() bool { return p.stage("created") == 0 && p.stage("applied") == 0 })

	// 1. One order, from the page, all the way, with its trace.
	first := p.clickForOrder("place-order")
	p.waitUntil("the order applied once", func() bool {
		j := p.journey()
		return strings.Contains(j, "order.created v1") && strings.Contains(j, "applied once") && strings.Contains(j, "delivered 1×")
	})
	p.waitUntil("one order created and applied", func() bool {
		return p.stage("created") == 1 && p.stage("applied") == 1 && p.stage("pending") == 0
	})
	stored := storedTraceID(t, dbURL, first)
	if stored == "" {
		t.Fatalf("order %s: its event carries no valid traceparent with tracing on", first)
	}
	if got := p.eval(`document.querySelector("#journey-rows .trace-id").textContent`); got != stored {
		t.Errorf("the journey shows trace %q, the event carries %q", got, stored)
	}
	if got, want := p.eval(`document.querySelector("#journey-rows .trace a").href`), jaeger+"/trace/"+stored; got != want {
		t.Errorf("the trace links to %q, want %q", got, want)
	}
	axeCheck(t, p, "an order applied")

	// 2. No relay: the order is taken, its event waits.
	p.click("stop-relays")
	p.waitUntil("both relays down", func() bool {
		return p.eval(`document.getElementById("proc-relay-1").dataset.state`) == procStopped &&
			p.eval(`document.getElementById("proc-relay-2").dataset.state`) == procStopped
	})
	p.clickForOrder("place-order")
	p.waitUntil("the second order created, its event pending", func() bool {
		return p.stage("created") == 2 && p.stage("pending") == 1 && p.oldestAge() > 0 && strings.Contains(p.journey(), "not applied yet")
	})
	oldest := p.oldestAge()
	p.waitUntil("the oldest pending age growing", func() bool { return p.oldestAge() > oldest })
	// The loss audit, a process of the demo, sees the same from the stores:
	// one event applied, one pending (younger than its grace), the flow
	// whole.
	p.waitUntil("the audit: one applied, one pending, whole", func() bool {
		return p.auditState() == "whole" && p.auditCount("checked") == 2 && p.auditCount("applied") == 1 && p.auditCount("pending") == 1
	})
	if n := p.stage("applied"); n != 1 {
		t.Fatalf("with both relays stopped, applied = %d, want 1", n)
	}
	if j := p.journey(); !strings.Contains(j, "pending") || !strings.Contains(j, "not applied yet") {
		t.Fatalf("the journey of the held order does not say it waits:\n%s", j)
	}
	// Select the waiting event's message id, as a reader about to copy it.
	msgID := p.eval(`(() => {
		const el = document.querySelector("#journey-rows .message-id");
		const r = document.createRange();
		r.selectNodeContents(el);
		getSelection().removeAllRanges();
		getSelection().addRange(r);
		return getSelection().toString();
	})()`)
	if _, _, err := outbox.ParseMessageID(msgID); err != nil {
		t.Fatalf("selected %q, want a message id: %v", msgID, err)
	}

	// The relays come back (a click that does not move the selection); the
	// outbox drains; nothing lost, nothing twice; the selection stayed.
	p.run("start the relays", chromedp.Evaluate[chromedp.Void](`document.querySelector("#action-start-relays button").click()`))
	p.waitUntil("pending back to 0 and both orders applied", func() bool {
		return p.stage("pending") == 0 && p.stage("applied") == 2 && p.stage("created") == 2 && p.stage("published") == 2
	})
	p.waitUntil("the second order applied once", func() bool { return strings.Contains(p.journey(), "applied once") })
	if got := p.eval(`getSelection().toString()`); got != msgID {
		t.Errorf("after its row updated, the selection is %q, want the message id %q: the row was rebuilt", got, msgID)
	}
	if n := p.stage("duplicates"); n != 0 {
		t.Errorf("duplicates absorbed = %d after a clean run, want 0", n)
	}

	// 3. A page elsewhere posts "stop both relays" to the live view, as a
	// form does (no script needed, no CORS preflight): refused, nothing
	// stopped.
	before := state(t, base)
	attacker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, `<!doctype html><html lang="en"><title>elsewhere</title>`+
			`<form method="post" action="%s/api/actions/stop-relays"></form><script>document.forms[0].submit()</script></html>`, base)
	}))
	t.Cleanup(attacker.Close)
	au, _ := url.Parse(attacker.URL)
	p.run("open a page on another site", chromedp.Navigate("http://localhost:"+au.Port()+"/"))
	p.waitUntil("the form's answer", func() bool { return p.eval(`location.href`) == base+"/api/actions/stop-relays" })
	if body := p.eval(`document.body.innerText`); !strings.Contains(body, `"cross_origin"`) {
		t.Errorf("the cross-site form's answer: %s, want the cross_origin error", body)
	}
	// A reading begun after the answer.
	answered := time.Now()
	after := state(t, base)
	p.waitUntil("a reading after the form's answer", func() bool {
		after = state(t, base)
		return after.At.After(answered)
	})
	for _, name := range []string{"relay-1", "relay-2"} {
		b, a := processByName(before, name), processByName(after, name)
		if a.State != procRunning || a.PID != b.PID {
			t.Errorf("%s after the cross-site form: %s pid %d, before: %s pid %d", name, a.State, a.PID, b.State, b.PID)
		}
	}
	if !strings.Contains(d.out.String(), "refused a cross-origin POST /api/actions/stop-relays") {
		t.Error("the demo's terminal does not say it refused the cross-site form")
	}
	p.run("back to the live view", chromedp.Navigate(base+"/?order="+first), chromedp.WaitVisible(chromedp.ID("stage-created")))
	p.waitUntil("the reading after the way back", func() bool { return p.stage("applied") == 2 && strings.Contains(p.journey(), "applied once") })

	// 4a. Relay-1 dies after RabbitMQ confirmed its publish, before it marks
	// the row: the row is published again when the lease ends, delivered a
	// second time, and the inbox absorbs it.
	p.clickForOrder("crash-relay")
	p.waitUntil("the relay crash's order delivered twice, applied once", func() bool {
		j := p.journey()
		return strings.Contains(j, "delivered 2×") && strings.Contains(j, "duplicate (inbox)") && strings.Contains(j, "applied once") &&
			strings.Contains(j, "published ")
	})
	p.waitUntil("the duplicate counted", func() bool { return p.stage("duplicates") >= 1 })
	if path := os.Getenv("LIVE_VIEW_SCREENSHOT"); path != "" {
		p.screenshot(path, true)
	}
	axeCheck(t, p, "after the relay crash")
	p.run("start relay-2", chromedp.Click(chromedp.CSS(`#proc-relay-2 button[data-action="start"]`)))
	p.waitUntil("relay-2 up again", func() bool {
		return p.eval(`document.getElementById("proc-relay-2").dataset.state`) == procRunning
	})

	// 4b. Shipping dies after its effect, before its ack: RabbitMQ delivers
	// the message again to the restarted shipping, which recognises it.
	p.clickForOrder("crash-shipping")
	p.waitUntil("the shipping crash's order delivered twice, applied once", func() bool {
		j := p.journey()
		return strings.Contains(j, "delivered 2×") && strings.Contains(j, "duplicate (") && strings.Contains(j, "applied once") &&
			!strings.Contains(j, "times!")
	})
	p.waitUntil("applied = created = published, nothing pending, both duplicates counted", func() bool {
		return p.stage("created") == 4 && p.stage("applied") == 4 && p.stage("published") == 4 && p.stage("pending") == 0 &&
			p.stage("duplicates") >= 2
	})
	// 5. The loss audit's last result, on the page and in /api/state: every
	// event the outbox committed (counted by the live view's own query)
	// applied, nothing missing, no phantom.
	p.waitUntil("the audit: all four events applied, whole", func() bool {
		return p.auditState() == "whole" && p.auditCount("checked") == 4 && p.auditCount("applied") == 4 &&
			p.auditCount("missing") == 0 && p.auditCount("phantom") == 0 && p.auditCount("pending") == 0
	})
	if s := state(t, base); s.Audit == nil || s.Stages.EventsWritten == nil || s.Audit.Checked != *s.Stages.EventsWritten ||
		s.Audit.Applied.Count != s.Audit.Checked || !s.Audit.Whole {
		t.Fatalf("/api/state: audit %+v, events written %v: want every event written checked and applied, whole", s.Audit, s.Stages.EventsWritten)
	}
	if got := p.eval(`document.getElementById("audit-verdict").textContent`); !strings.HasPrefix(got, "✓ Whole") {
		t.Errorf("audit verdict %q, want it whole", got)
	}
	if got := p.eval(`document.getElementById("audit-alarm").hidden`); got != "true" {
		t.Errorf("the audit alarm shows (hidden=%s) while the flow is whole", got)
	}
	p.screenshot(artifactPath("demo-live-view.png"), false)

	// Tamper: an inbox record of an event the outbox never committed, as
	// shipping's inbox writes one. The next audit finds the phantom and the
	// page raises the alarm.
	tamperClient, err := mongodriver.Connect(options.Client().ApplyURI(env["MONGO_URI"]))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tamperClient.Disconnect(context.Background()) })
	in, err := inbox.New(tamperClient.Database("shipping"), inbox.Config{Consumer: "shipping"})
	if err != nil {
		t.Fatal(err)
	}
	const phantom = "987654321"
	if _, err := in.Process(t.Context(), phantom, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	p.waitUntil("the audit's alarm: one phantom", func() bool {
		return p.auditState() == "not-whole" && p.auditCount("phantom") == 1 &&
			p.eval(`document.getElementById("audit-alarm").hidden`) == "false"
	})
	if got := p.eval(`document.getElementById("audit-alarm").textContent`); !strings.Contains(got, "not whole") || !strings.Contains(got, phantom) {
		t.Errorf("audit alarm %q, want it to say the flow is not whole and name %s", got, phantom)
	}
	if got := p.eval(`document.getElementById("audit-alarm").getAttribute("role")`); got != "alert" {
		t.Errorf("the audit alarm's role is %q, want alert", got)
	}
	if got := p.eval(`document.getElementById("audit-verdict").textContent`); !strings.Contains(got, "NOT WHOLE: 0 missing, 1 phantom") {
		t.Errorf("audit verdict %q", got)
	}
	if s := state(t, base); s.Audit == nil || s.Audit.Whole || s.Audit.Phantom.Count != 1 || len(s.Audit.Phantom.Examples) != 1 || s.Audit.Phantom.Examples[0] != phantom ||
		s.Audit.Missing.Count != 0 || s.Audit.Applied.Count != 4 {
		t.Fatalf("/api/state after the tamper: audit %+v, want 4 applied, the phantom %s, not whole", s.Audit, phantom)
	}
	axeCheck(t, p, "the audit's alarm")
	js.check()

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

// storedTraceID is the trace id of the traceparent stored with the order's
// order.created event, read from the outbox's published rows.
func storedTraceID(t *testing.T, dbURL, orderID string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var tp *string
	if err := conn.QueryRow(ctx, `SELECT headers->>'traceparent' FROM outbox_published
		WHERE aggregate_type = 'order' AND aggregate_id = $1 AND event_type = 'order.created'`, orderID).Scan(&tp); err != nil {
		t.Fatalf("the published row of order %s: %v", orderID, err)
	}
	if tp == nil {
		return ""
	}
	return traceID(*tp)
}

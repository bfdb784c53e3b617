package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"
)

// demo starts, watches and stops the processes.
type demo struct {
	cfg    config
	term   *terminal
	failed chan error

	procs      []*proc // in start order; fixed once startAll returned
	deliveries *deliveryLog
	// ctl is the live view's hold on the processes: the local supervisor
	// here, docker compose in compose mode (compose.go).
	ctl processController
}

func newDemo(cfg config, out io.Writer) *demo {
	return &demo{cfg: cfg, term: &terminal{w: out}, failed: make(chan error, 8), deliveries: newDeliveryLog()}
}

const nameWidth = len("mongolocal")

func (d *demo) say(format string, args ...any) {
	d.term.println(fmt.Sprintf("%-*s | ", nameWidth, "demo") + fmt.Sprintf(format, args...))
}

// run starts everything, waits for ctx to end or a process to fail for good,
// then stops everything.
func (d *demo) run(ctx context.Context) (err error) {
	if err := d.checkPortsFree(); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(d.cfg.StateDir, "run"), 0o755); err != nil {
		return fmt.Errorf("create state directory: %w", err)
	}
	defer func() { err = errors.Join(err, d.stopAll()) }()

	if err := d.startAll(ctx); err != nil {
		if ctx.Err() != nil {
			return nil // interrupted while starting: not a failure
		}
		return err
	}
	d.ctl = &localController{procs: d.procs, grace: d.cfg.StopTimeout}
	view, err := startLiveView(ctx, d)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, view.close()) }()
	d.banner()
	select {
	case <-ctx.Done():
		d.say("stopping (applications first, then the embedded MongoDB)")
		return nil
	case err := <-d.failed:
		d.say("giving up: %v", err)
		return err
	}
}

// checkPortsFree fails early, with a clear message, when a previous demo (or
// anything else) still holds one of the addresses.
func (d *demo) checkPortsFree() error {
	mongo, _ := mongoAddr(d.cfg.MongoURI)
	for _, a := range []struct{ what, addr string }{
		{"orders API", d.cfg.OrdersAddr}, {"shipping API", d.cfg.ShippingAddr},
		{"relay-1", d.cfg.RelayAddr}, {"relay-2", d.cfg.Relay2Addr},
		{"live view", d.cfg.UIAddr}, {"loss audit", d.cfg.AuditAddr}, {"embedded MongoDB", mongo},
	} {
		ln, err := net.Listen("tcp", a.addr)
		if err != nil {
			return fmt.Errorf("%s address %s is taken (is a demo already running? stop it with Ctrl-C): %w", a.what, a.addr, err)
		}
		_ = ln.Close()
	}
	return nil
}

func (d *demo) startAll(ctx context.Context) error {
	bin := func(name string) string { return filepath.Join(d.cfg.BinDir, name) }
	mongo, _ := mongoAddr(d.cfg.MongoURI)
	ordersEnv := []string{
		"DATABASE_URL=" + d.cfg.DatabaseURL,
		"AMQP_URL=" + d.cfg.AMQPURL,
	}

	// The embedded MongoDB first: the shipping service needs it to start.
	if err := d.startAndWait(ctx, procSpec{
		name:    "mongolocal",
		path:    bin("mongolocal"),
		args:    []string{"-data-dir", filepath.Join(d.cfg.StateDir, "mongolocal")},
		env:     []string{"MONGO_URI=" + d.cfg.MongoURI},
		ready:   tcpReady(mongo),
		restart: true,
	}); err != nil {
		return err
	}

	// Create the database and schema first: only `orders migrate` runs DDL;
	// the orders API and relay check the schema and refuse to start without it.
	d.say("orders migrate: creating the database and schema if needed")
	migrate := exec.CommandContext(ctx, bin("orders"), "migrate")
	migrate.Env = append(os.Environ(), ordersEnv...)
	migrate.Stdout = newPrefixer(d.term, "orders", nameWidth)
	migrate.Stderr = migrate.Stdout
	if err := migrate.Run(); err != nil {
		return fmt.Errorf("orders migrate: %w", err)
	}

	// Shipping before orders: it declares the queue the relay's events are
	// routed to (an event published before any queue exists is unroutable,
	// and the relay retries it with backoff). Shipping logs at the debug
	// level: its line per settled delivery feeds the live view (and is kept
	// off the terminal). The orders API runs without a relay of its own
	// (RELAY=false; it then sends NOTIFY on every write, and the relays
	// LISTEN), so that the live view can stop every relay and still take
	// orders.
	specs := []procSpec{
		{
			name:    "shipping",
			path:    bin("shipping"),
			env:     []string{"AMQP_URL=" + d.cfg.AMQPURL, "MONGO_URI=" + d.cfg.MongoURI, "HTTP_ADDR=" + d.cfg.ShippingAddr, "LOG_LEVEL=debug"},
			ready:   httpReady("http://" + d.cfg.ShippingAddr + "/readyz"),
			restart: true,
			keep:    d.deliveries.line,
		},
		{
			name:    "orders",
			path:    bin("orders"),
			env:     append(slicesClone(ordersEnv), "HTTP_ADDR="+d.cfg.OrdersAddr, "RELAY=false"),
			ready:   httpReady("http://" + d.cfg.OrdersAddr + "/readyz"),
			restart: true,
		},
		{
			name:    "relay-1",
			path:    bin("orders"),
			args:    []string{"relay"},
			env:     append(slicesClone(ordersEnv), "HTTP_ADDR="+d.cfg.RelayAddr),
			ready:   httpReady("http://" + d.cfg.RelayAddr + "/readyz"),
			restart: true,
		},
		{
			name:    "relay-2",
			path:    bin("orders"),
			args:    []string{"relay"},
			env:     append(slicesClone(ordersEnv), "HTTP_ADDR="+d.cfg.Relay2Addr),
			ready:   httpReady("http://" + d.cfg.Relay2Addr + "/readyz"),
			restart: true,
		},
	}
	// The loss audit last, in its continuous mode: it compares the outbox
	// with shipping's inbox every AuditEvery and serves the last report,
	// which the live view shows. Its window runs up to now (-until 0s):
	// an event younger than its grace and not applied yet is pending, not
	// missing. FerretDB reads and sorts the whole inbox for each page:
	// one page holds it all. Every cycle is a full audit (-full-every as
	// long as -every), so that a phantom shows at the next one.
	specs = append(specs, procSpec{
		name: "audit",
		path: bin("audit"),
		args: []string{"-every", d.cfg.AuditEvery.String(), "-full-every", d.cfg.AuditEvery.String(), "-metrics-addr", d.cfg.AuditAddr,
			"-grace", auditGrace.String(), "-until", "0s", "-inbox-page-size", "10000000"},
		env:     []string{"DATABASE_URL=" + d.cfg.DatabaseURL, "MONGO_URI=" + d.cfg.MongoURI},
		ready:   httpReady("http://" + d.cfg.AuditAddr + "/healthz"),
		restart: true,
		keep:    auditLine,
	})
	for _, s := range specs {
		if err := d.startAndWait(ctx, s); err != nil {
			return err
		}
	}
	if d.cfg.Load {
		return d.startAndWait(ctx, procSpec{
			name: "loadgen",
			path: bin("loadgen"),
			args: []string{"-url", "http://" + d.cfg.OrdersAddr, "-rate", fmt.Sprint(d.cfg.LoadRate), "-duration", "10m"},
		})
	}
	return nil
}

func slicesClone(s []string) []string { return append([]string(nil), s...) }

// auditGrace is how long the demo's audit lets an event be in flight before
// it calls it missing: the guided faults (a relay's lease of 30 s, a
// shipping restart) delay an event by less.
const auditGrace = time.Minute

// auditLine keeps the audit's lines off the terminal while the flow is
// whole (one every AuditEvery): the live view shows its result.
func auditLine(line []byte) bool {
	return !bytes.Contains(line, []byte(`"msg":"audit: the flow is whole"`))
}

// startAndWait starts a process and waits until it is ready, it dies, or
// ReadyTimeout passes.
func (d *demo) startAndWait(ctx context.Context, s procSpec) error {
	out := newPrefixer(d.term, s.name, nameWidth)
	out.keep = s.keep
	p := &proc{
		spec:    s,
		out:     out,
		pidFile: pidFilePath(d.cfg.StateDir, s.name),
		failed:  d.failed,
	}
	if err := p.start(); err != nil {
		return err
	}
	d.procs = append(d.procs, p)
	if s.ready == nil {
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, d.cfg.ReadyTimeout)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- s.ready(rctx) }()
	select {
	case err := <-errc:
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("%s did not become ready within %s: %w", s.name, d.cfg.ReadyTimeout, err)
		}
		return nil
	case <-p.running():
		cancel()
		<-errc
		return fmt.Errorf("%s exited while starting (its output is above)", s.name)
	}
}

// stopAll stops the load generator, then the services together, then the
// embedded MongoDB they write to.
func (d *demo) stopAll() error {
	tiers := make([][]*proc, 3)
	for _, p := range d.procs {
		switch p.spec.name {
		case "loadgen":
			tiers[0] = append(tiers[0], p)
		case "mongolocal":
			tiers[2] = append(tiers[2], p)
		default:
			tiers[1] = append(tiers[1], p)
		}
	}
	var mu sync.Mutex
	var errs []error
	for _, tier := range tiers {
		var wg sync.WaitGroup
		for _, p := range tier {
			wg.Go(func() {
				if err := p.stop(d.cfg.StopTimeout); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	}
	if len(d.procs) > 0 {
		d.say("all processes stopped")
	}
	return errors.Join(errs...)
}

func (d *demo) banner() {
	pids := map[string]int{}
	for _, p := range d.procs {
		pids[p.spec.name] = p.pid()
	}
	run := filepath.Join(d.cfg.StateDir, "run")
	lines := []string{
		"",
		"everything is up; Ctrl-C stops it all",
		"",
		fmt.Sprintf("  LIVE VIEW     http://%s        <- open this: watch the flow, break things with a click", d.cfg.UIAddr),
		"",
		fmt.Sprintf("  orders API    http://%s        (API, pid %d)", d.cfg.OrdersAddr, pids["orders"]),
		fmt.Sprintf("  relay-1       http://%s        (standalone relay, pid %d)", d.cfg.RelayAddr, pids["relay-1"]),
		fmt.Sprintf("  relay-2       http://%s        (standalone relay, pid %d)", d.cfg.Relay2Addr, pids["relay-2"]),
		fmt.Sprintf("  shipping API  http://%s        (pid %d)", d.cfg.ShippingAddr, pids["shipping"]),
		fmt.Sprintf("  loss audit    http://%s/report (every %s, pid %d)", d.cfg.AuditAddr, d.cfg.AuditEvery, pids["audit"]),
		fmt.Sprintf("  PostgreSQL    %s", redacted(d.cfg.DatabaseURL)),
		fmt.Sprintf("  RabbitMQ      %s", redacted(d.cfg.AMQPURL)),
		fmt.Sprintf("  MongoDB       %s  (embedded FerretDB, pid %d, data in %s)", redacted(d.cfg.MongoURI), pids["mongolocal"], filepath.Join(d.cfg.StateDir, "mongolocal")),
		fmt.Sprintf("  pid files     %s", run),
	}
	if d.cfg.JaegerUI != "" {
		lines = append(lines, fmt.Sprintf("  Jaeger        %s  (the live view links each event's trace there)", d.cfg.JaegerUI))
	}
	if d.cfg.Load {
		lines = append(lines, fmt.Sprintf("  load          %v orders/s for 10m (pid %d)", d.cfg.LoadRate, pids["loadgen"]))
	}
	lines = append(lines,
		"",
		"  try it:  curl -s -X POST http://"+d.cfg.OrdersAddr+"/orders -H 'Content-Type: application/json' \\",
		`             -d '{"customer_id": "c-42", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]}'`,
		"  then:    curl -s http://"+d.cfg.ShippingAddr+"/shipments/ORDER_ID",
		"  guided tour: docs/demo.md",
		"",
	)
	for _, l := range lines {
		d.say("%s", l)
	}
}

// tcpReady waits until addr accepts TCP connections.
func tcpReady(addr string) func(context.Context) error {
	return func(ctx context.Context) error {
		var dialer net.Dialer
		return poll(ctx, func() error {
			c, err := dialer.DialContext(ctx, "tcp", addr)
			if err == nil {
				_ = c.Close()
			}
			return err
		})
	}
}

// httpReady waits until url answers 2xx.
func httpReady(url string) func(context.Context) error {
	return func(ctx context.Context) error {
		// No keep-alive: a probe leaves no idle connection (and goroutine) behind.
		client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
		return poll(ctx, func() error {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			if err != nil {
				return err
			}
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			_ = resp.Body.Close()
			if resp.StatusCode/100 != 2 {
				return fmt.Errorf("GET %s: %s", url, resp.Status)
			}
			return nil
		})
	}
}

// poll calls try every 100ms until it succeeds or ctx ends, and returns the
// last error then.
func poll(ctx context.Context, try func() error) error {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		err := try()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-t.C:
		}
	}
}

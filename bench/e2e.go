package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// shippingEventsCollection is where the shipping service writes one
// document per applied event, _id "order id/version", with applied_at
// (services/shipping/internal/mongodb).
const shippingEventsCollection = "shipment_events"

// goCommand returns the go tool: the one on PATH, else $GOROOT/bin/go.
func goCommand() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	if root := os.Getenv("GOROOT"); root != "" {
		return filepath.Join(root, "bin", "go")
	}
	return "go"
}

// buildShipping builds the shipping service into dir and returns the binary.
func (b *bench) buildShipping(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "shipping")
	cmd := exec.CommandContext(ctx, goCommand(), "build", "-o", bin, "./services/shipping")
	cmd.Dir = b.env.root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build ./services/shipping: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return bin, nil
}

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// startShipping runs the shipping binary against url and mongoURI, logging to
// logPath, and waits until its /readyz answers 200. It returns a function
// that stops the process, and its PID; the run's close stops it too.
func (b *bench) startShipping(ctx context.Context, bin, url, mongoURI, logPath string) (func() error, int, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, 0, err
	}
	env := append(os.Environ(), "AMQP_URL="+url, "MONGO_URI="+mongoURI, "HTTP_ADDR="+addr, "LOG_LEVEL=warn")
	cmd := exec.Command(bin)
	stop, err := b.startProcess(ctx, "shipping", cmd, env, addr, logPath)
	if err != nil {
		return nil, 0, err
	}
	return stop, cmd.Process.Pid, nil
}

// startProcess starts cmd with env, logging to logPath, and waits until
// http://addr/readyz answers 200. It returns a function that stops the
// process (SIGTERM, then SIGKILL after 20s), which the run's close calls too.
func (b *bench) startProcess(ctx context.Context, name string, cmd *exec.Cmd, env []string, addr, logPath string) (func() error, error) {
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	var once sync.Once
	var stopErr error
	stop := func() error {
		once.Do(func() {
			defer logFile.Close()
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(20 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
				stopErr = fmt.Errorf("%s did not stop within 20s of SIGTERM; killed", name)
			}
		})
		return stopErr
	}
	b.env.onClose(name+" process "+addr, func(context.Context) error { return stop() })

	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := client.Get("http://" + addr + "/readyz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return stop, nil
			}
		}
		select {
		case <-exited:
			return nil, fmt.Errorf("%s exited before it was ready (%v); see %s", name, waitErr, logPath)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%s not ready after 90s; see %s", name, logPath)
		}
	}
}

// tap is a consumer of its own on the events exchange: it records when each
// order's first event reached a consumer, which is the relay's share of the
// end-to-end latency.
type tap struct {
	conn *amqp.Connection
	done chan struct{}

	mu      sync.Mutex
	arrived map[string]time.Time // by aggregate_id
}

func startTap(url string) (*tap, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return nil, fmt.Errorf("tap: dial: %w", err)
	}
	t := &tap{conn: conn, done: make(chan struct{}), arrived: map[string]time.Time{}}
	fail := func(err error) (*tap, error) {
		_ = conn.Close()
		return nil, fmt.Errorf("tap: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		return fail(err)
	}
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fail(err)
	}
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		return fail(err)
	}
	if err := ch.QueueBind(q.Name, "order.*", exchange, false, nil); err != nil {
		return fail(err)
	}
	deliveries, err := ch.Consume(q.Name, "bench-tap", true, true, false, false, nil)
	if err != nil {
		return fail(err)
	}
	go func() {
		defer close(t.done)
		for d := range deliveries {
			now := time.Now()
			id, _ := d.Headers["aggregate_id"].(string)
			t.mu.Lock()
			if _, seen := t.arrived[id]; !seen {
				t.arrived[id] = now
			}
			t.mu.Unlock()
		}
	}()
	return t, nil
}

// missing counts the commits whose order the tap has not seen yet.
func (t *tap) missing(commits []commit) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, c := range commits {
		if _, ok := t.arrived[c.orderID]; !ok {
			n++
		}
	}
	return n
}

func (t *tap) stop() map[string]time.Time {
	_ = t.conn.Close()
	<-t.done
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.arrived
}

// e2eVariant is one way the relay learns about new rows.
type e2eVariant struct {
	name       string
	wake       bool // in-process Wake after each commit
	notify     bool // NOTIFY in the writer's transaction, LISTEN in the relay
	noShipping bool // no shipping service: only the tap consumes (the relay's path alone)
	wal        bool // the WAL relay (pkg/outbox/outboxwal) instead of the polling relay
}

type commit struct {
	orderID string
	at      time.Time
}

// e2eResult is what one variant measured.
type e2eResult struct {
	applied   []time.Duration // commit to shipment applied
	delivered []time.Duration // commit to first delivery to a consumer
	late      int             // orders not applied by the deadline
	// cpu is what each process group spent during the measured load.
	cpu    cpuUse
	tail   tailReport
	window time.Duration // the interval cpu covers
	// statements are the polling relay's claims and batches (marks, outcomes)
	// during the measured load, per order, and their mean time.
	statements map[string]float64
}

// statementsPerOrder summarises a sqlTimer's recording over orders: for each
// kind of statement, how many per order and their mean latency in ms.
func statementsPerOrder(byKind map[string][]time.Duration, orders int) map[string]float64 {
	if len(byKind) == 0 || orders == 0 {
		return nil
	}
	out := map[string]float64{}
	for kind, ds := range byKind {
		var sum time.Duration
		for _, d := range ds {
			sum += d
		}
		out[kind+"_per_order"] = round(float64(len(ds)) / float64(orders))
		if len(ds) > 0 {
			out[kind+"_mean_ms"] = round(ms(sum) / float64(len(ds)))
		}
	}
	return out
}

// instrumentText says what the e2e figures' cpu_per_order and tail details
// hold.
const instrumentText = "cpu_per_order: CPU time per measured order, in µs, over the measured load, " +
	"by group: relay is the benchmark's process (the relay, the writer and the tap), shipping the shipping process, mongodb the FerretDB process shipping uses; " +
	"cores_busy: that CPU over the interval's wall time, in cores. tail: the orders at or above the p99, where their time went " +
	"(median relay and shipping shares), in how many separate seconds they were committed, and the machine's CPU (/proc/stat: busy, " +
	"iowait, steal) while they waited and over the whole window. relay_statements: the polling relay's claims (claim: it found rows; claim_empty: " +
	"none) and batches (its marks and outcomes) per order over the measured load, and their mean latency"

// measureE2E runs one variant in resources of its own (vhost, Mongo
// database, shipping process): it writes orders at b.cfg.e2eRate for the
// warm-up and the measured window, with the variant's wake-up path, then
// waits up to b.cfg.e2eDrainWait for shipping to apply every measured order.
// An order still not applied then counts with its latency at the deadline (a
// lower bound).
func (b *bench) measureE2E(ctx context.Context, bin, tmp string, poolCfg *pgxpool.Config, pool *pgxpool.Pool, v e2eVariant) (e2eResult, error) {
	url, err := b.env.newVhost(ctx, "e2e-"+v.name)
	if err != nil {
		return e2eResult{}, err
	}
	// shipping's MongoDB: a FerretDB process, so that the CPU instrument
	// reads it apart from the benchmark's process.
	ferretURI, ferretPID, err := b.ferretProcess(ctx)
	if err != nil {
		return e2eResult{}, err
	}
	db, mongoURI, err := b.env.newMongoDatabaseAt(ctx, ferretURI, "e2e_"+v.name, 10)
	if err != nil {
		return e2eResult{}, err
	}
	tp, err := startTap(url)
	if err != nil {
		return e2eResult{}, err
	}
	tapStopped := false
	defer func() {
		if !tapStopped {
			tp.stop()
		}
	}()
	meter := newCPUMeter(ctx, pool, url, "")
	meter.mongoPID = ferretPID
	if !v.noShipping {
		stopShipping, pid, err := b.startShipping(ctx, bin, url, strings.TrimSuffix(mongoURI, "/")+"/"+db.Name(),
			filepath.Join(tmp, "shipping-"+v.name+".log"))
		if err != nil {
			return e2eResult{}, err
		}
		defer stopShipping() //nolint:errcheck // also stopped, and reported, by the run's close
		meter.shippingPID = pid
	}
	events := db.Collection(shippingEventsCollection)

	cfg := b.relayConfig()
	wcfg := outbox.WriterConfig{}
	if v.notify {
		cfg.NotifyChannel = notifyChannel
		wcfg.NotifyChannel = notifyChannel
	}
	writer, err := outbox.NewWriter(wcfg)
	if err != nil {
		return e2eResult{}, err
	}
	var relay *runningRelay
	var timer *sqlTimer // the polling relay's statements (the WAL relay claims nothing)
	if v.wal {
		relay, err = b.startWALRelay(ctx, poolCfg, url, b.walSlotName("e2e_"+v.name))
	} else {
		timer = newSQLTimer()
		relay, err = startRelay(ctx, poolCfg, url, cfg, timer)
	}
	if err != nil {
		return e2eResult{}, err
	}
	defer relay.stop()

	var mu sync.Mutex
	var commits []commit
	write := func(record bool) func(context.Context, int) error {
		return func(ctx context.Context, i int) error {
			id, at, err := createOrder(ctx, pool, writer, i)
			if err != nil {
				return err
			}
			if v.wake {
				relay.relay.Wake()
			}
			if record {
				mu.Lock()
				commits = append(commits, commit{id, at})
				mu.Unlock()
			}
			return nil
		}
	}
	// The warm-up also gives the LISTEN connection time to come up.
	if _, err := paced(ctx, b.cfg.e2eRate, b.cfg.e2eWarmup, 32, write(false)); err != nil {
		return e2eResult{}, fmt.Errorf("warm-up: %w", err)
	}
	sampler, err := startMachineSampler(ctx, 100*time.Millisecond)
	if err != nil {
		return e2eResult{}, fmt.Errorf("machine CPU: %w", err)
	}
	defer sampler.finish()
	iv, err := meter.start(ctx, "e2e_"+v.name)
	if err != nil {
		return e2eResult{}, err
	}
	if timer != nil {
		timer.start()
	}
	loadStart := time.Now()
	if _, err := paced(ctx, b.cfg.e2eRate, b.cfg.e2eDuration, 32, write(true)); err != nil {
		return e2eResult{}, fmt.Errorf("load: %w", err)
	}
	var statements map[string][]time.Duration
	if timer != nil {
		statements = timer.stop()
	}
	// The CPU interval is the measured load's: at a steady rate after the
	// warm-up, the orders still in flight at its end weigh what those in
	// flight at its start did.
	use, err := iv.stop(ctx, len(commits))
	if err != nil {
		return e2eResult{}, fmt.Errorf("CPU per order: %w", err)
	}
	window := time.Since(loadStart)
	// measured adds the instrument's readings to res once every order
	// arrived (or the wait ended).
	measured := func(res *e2eResult, trips []orderTrip) {
		res.cpu, res.window = use, window
		res.tail = tailOf(trips, sampler.finish())
		res.statements = statementsPerOrder(statements, len(commits))
	}

	if v.noShipping {
		// Only the relay's share: wait for the tap to see every order.
		deadline := time.Now().Add(b.cfg.e2eDrainWait)
		for time.Now().Before(deadline) && tp.missing(commits) > 0 {
			time.Sleep(100 * time.Millisecond)
		}
		arrived := tp.stop()
		tapStopped = true
		var res e2eResult
		var trips []orderTrip
		for _, c := range commits {
			if at, ok := arrived[c.orderID]; ok {
				res.delivered = append(res.delivered, at.Sub(c.at))
				trips = append(trips, orderTrip{committed: c.at, delivered: at, latency: at.Sub(c.at)})
			} else {
				res.late++
			}
		}
		measured(&res, trips)
		return res, nil
	}

	// Wait for shipping to apply every measured order.
	want := make(map[string]bool, len(commits))
	for _, c := range commits {
		want[c.orderID+"/1"] = true
	}
	applied := map[string]time.Time{}
	deadline := time.Now().Add(b.cfg.e2eDrainWait)
	for len(applied) < len(want) && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return e2eResult{}, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
		cur, err := events.Find(ctx, bson.D{}, options.Find().SetProjection(bson.D{{Key: "applied_at", Value: 1}}))
		if err != nil {
			return e2eResult{}, fmt.Errorf("read shipments: %w", err)
		}
		var docs []struct {
			ID        string    `bson:"_id"`
			AppliedAt time.Time `bson:"applied_at"`
		}
		if err := cur.All(ctx, &docs); err != nil {
			return e2eResult{}, fmt.Errorf("read shipments: %w", err)
		}
		for _, d := range docs {
			if want[d.ID] {
				applied[d.ID] = d.AppliedAt
			}
		}
	}
	gaveUp := time.Now()
	arrived := tp.stop()
	tapStopped = true

	// applied_at is a BSON date: milliseconds, truncated. Rounding it up to
	// the next millisecond makes each latency an upper bound.
	var res e2eResult
	trips := make([]orderTrip, 0, len(commits))
	for _, c := range commits {
		trip := orderTrip{committed: c.at}
		if at, ok := applied[c.orderID+"/1"]; ok {
			trip.latency = at.Add(time.Millisecond).Sub(c.at)
		} else {
			res.late++
			trip.latency = gaveUp.Sub(c.at)
		}
		res.applied = append(res.applied, trip.latency)
		if at, ok := arrived[c.orderID]; ok {
			res.delivered = append(res.delivered, at.Sub(c.at))
			trip.delivered = at
		}
		trips = append(trips, trip)
	}
	measured(&res, trips)
	return res, nil
}

// instrument returns what the instrument read of a variant, for its
// details (see instrumentText).
func (r e2eResult) instrument() map[string]any {
	m := map[string]any{"tail": r.tail}
	if r.statements != nil {
		m["relay_statements"] = r.statements
	}
	if per := r.cpu.perEvent(); per != nil {
		m["cpu_per_order"] = per
		if r.window > 0 {
			m["cores_busy"] = round(r.cpu.total().Seconds() / r.window.Seconds())
		}
	}
	return m
}

// runE2ELatency measures e2e_latency: from an order's commit (the orders
// service's transaction, Enqueue included) to its shipment event applied by
// the real shipping service (built from ./services/shipping, on the embedded
// FerretDB), through the real relay (pkg/outbox with outboxamqp, in this
// process), at a steady rate, for each wake-up path and for polling alone.
func (b *bench) runE2ELatency(ctx context.Context) ([]Figure, error) {
	tmp, err := os.MkdirTemp("", "bench-e2e-")
	if err != nil {
		return nil, err
	}
	b.env.onClose("e2e temp dir "+tmp, func(context.Context) error { return os.RemoveAll(tmp) })
	start := time.Now()
	bin, err := b.buildShipping(ctx, tmp)
	if err != nil {
		return nil, err
	}
	b.log.Info("e2e_latency shipping built", "seconds", int(time.Since(start).Seconds()))

	poolCfg, pool, err := b.env.openDatabase(ctx, "e2e", b.migrateOrders)
	if err != nil {
		return nil, err
	}
	defer pool.Close()

	variants := []e2eVariant{
		{name: "wake", wake: true},
		{name: "notify", notify: true},
		{name: "poll"},
		{name: "wake_relay_only", wake: true, noShipping: true},
	}
	applied := map[string]Latencies{}
	delivered := map[string]Latencies{}
	details := map[string]any{"rate_per_s": b.cfg.e2eRate, "seconds": b.cfg.e2eDuration.Seconds(),
		"drain_wait_seconds": b.cfg.e2eDrainWait.Seconds(), "relay_config": b.relayConfigText(), "instrument": instrumentText}
	for _, v := range variants {
		res, err := b.measureE2E(ctx, bin, tmp, poolCfg, pool, v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.name, err)
		}
		d, err := summarize(res.delivered)
		if err != nil {
			return nil, fmt.Errorf("%s: delivered: %w", v.name, err)
		}
		delivered[v.name] = d
		vd := map[string]any{
			"delivered_p50_ms": ms(d.P50), "delivered_p90_ms": ms(d.P90), "delivered_p99_ms": ms(d.P99), "delivered_max_ms": ms(d.Max),
		}
		var a Latencies
		if v.noShipping {
			vd["orders"], vd["not_delivered_within_wait"] = d.N+res.late, res.late
		} else {
			if a, err = summarize(res.applied); err != nil {
				return nil, fmt.Errorf("%s: %w", v.name, err)
			}
			applied[v.name] = a
			vd["orders"], vd["not_applied_within_wait"] = a.N, res.late
			vd["applied_p50_ms"], vd["applied_p90_ms"], vd["applied_p99_ms"], vd["applied_max_ms"] = ms(a.P50), ms(a.P90), ms(a.P99), ms(a.Max)
		}
		vd["instrument"] = res.instrument()
		details[v.name] = vd
		b.log.Info("e2e_latency", "variant", v.name, "tail", res.tail, "applied_p50_ms", ms(a.P50), "applied_p99_ms", ms(a.P99),
			"delivered_p50_ms", ms(d.P50), "delivered_p99_ms", ms(d.P99), "late", res.late)
	}

	what := fmt.Sprintf("latency from an order's commit to its shipment applied by the shipping service (applied_at, rounded up to the ms), %d orders/s for %v", b.cfg.e2eRate, b.cfg.e2eDuration)
	tapWhat := fmt.Sprintf("latency from an order's commit to its event's delivery to a consumer of the exchange (the relay's share), %d orders/s for %v", b.cfg.e2eRate, b.cfg.e2eDuration)
	baseIs := "the same with polling only (the relay's default 1s ticker, no Wake, no NOTIFY)"
	wake, notify, poll := applied["wake"], applied["notify"], applied["poll"]
	dw, dn, dp, dr := delivered["wake"], delivered["notify"], delivered["poll"], delivered["wake_relay_only"]
	return []Figure{
		newFigure("e2e_latency_wake_p50", "ms", ms(wake.P50), ms(poll.P50), Goal{}, "p50 "+what+", in-process Wake after commit", baseIs, details),
		newFigure("e2e_latency_wake_p99", "ms", ms(wake.P99), ms(poll.P99), Goal{ValueAtMost, 25}, "p99 "+what+", in-process Wake after commit", baseIs, nil),
		newFigure("e2e_latency_notify_p50", "ms", ms(notify.P50), ms(poll.P50), Goal{}, "p50 "+what+", LISTEN/NOTIFY only", baseIs, nil),
		newFigure("e2e_latency_notify_p99", "ms", ms(notify.P99), ms(poll.P99), Goal{ValueAtMost, 25}, "p99 "+what+", LISTEN/NOTIFY only", baseIs, nil),
		newFigure("e2e_delivery_wake_p99", "ms", ms(dw.P99), ms(dp.P99), Goal{}, "p99 "+tapWhat+", in-process Wake", baseIs, nil),
		newFigure("e2e_delivery_notify_p99", "ms", ms(dn.P99), ms(dp.P99), Goal{}, "p99 "+tapWhat+", LISTEN/NOTIFY only", baseIs, nil),
		newFigure("e2e_delivery_relay_only_p99", "ms", ms(dr.P99), ms(dp.P99), Goal{}, "p99 "+tapWhat+", in-process Wake, no shipping service running (so it takes no CPU)", baseIs, nil),
	}, nil
}

// Command bench measures the performance goals of docs/guarantees.md on this machine, each
// against a baseline measured in the same run, prints them as a table and
// writes them to a JSON file (BENCH_OUT, default bench-results.json).
//
//	go run ./bench                     every figure (15 to 20 minutes here, and about 25 more for
//	                                   the audit figure, which reads a million inbox records from FerretDB four times)
//	go run ./bench -only relay_drain   some figures, comma-separated
//	go run ./bench -quick              smaller sizes, to check the harness
//
// Figures: relay_drain, relay_drain_wal, relay_drain_nats, relay_start_backlog, hot_aggregate (with hot_aggregate_writers and hot_aggregate_wal), relay_recovery,
// write_overhead, read_flat, e2e_latency, e2e_latency_wal, e2e_rate_sweep, claim_flat, status_scrape,
// inbox_throughput, audit (with audit_without_inbox_read and audit_incremental).
// See docs/benchmarks.md for what each
// measures and the latest numbers.
//
// Every run works in resources of its own, removed at the end: one PostgreSQL
// database per figure, RabbitMQ vhosts (created with rabbitmqctl), and
// databases on an embedded FerretDB. Connection settings:
//
//	BENCH_DATABASE_URL  any database of the server (default TEST_DATABASE_URL, else postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable)
//	BENCH_AMQP_URL      the broker (default TEST_AMQP_URL, else amqp://guest:guest@127.0.0.1:5672/)
//	BENCH_BROKER=private  a RabbitMQ node of the run's own instead (internal/rabbitnode, on a free
//	                    port, stopped at the end): no other traffic on it, nothing else restarts it
//	BENCH_NATS_URL      the NATS server of relay_drain_nats (default: one with JetStream in the benchmark's process)
//	BENCH_OUT           where the JSON goes (default bench-results.json)
//	BENCH_REPS          repetitions of the throughput figures (default 3)
//	BENCH_RELAY_BATCH_SIZE, BENCH_RELAY_WORKERS  relay tuning (default: the orders service's)
//	BENCH_RELAY_VACUUM_EVERY  the relays' VacuumEvery (default 0, auto, the orders service's)
//	BENCH_AUDIT_EVENTS  the events the audit figure audits (default 1,000,000)
//	BENCH_SWEEP_START_RATE, BENCH_SWEEP_STAGE_SECONDS  e2e_rate_sweep's first rate (orders/s, default 100)
//	                    and each stage's length (default 5)
//	BENCH_CPUPROFILE    a directory: a CPU profile of the benchmark's process (the relay, or the raw
//	                    publisher) over each measured drain of the relay figures, one file per drain
//	BENCH_KEEP=1        keep the PostgreSQL databases and vhosts for inspection
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-inbox/reference/internal/rabbitnode"
	"github.com/outbox-inbox/reference/pkg/outbox"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if os.Getenv(killedRelayEnv) != "" { // the relay relay_recovery kills
		if err := runKilledRelay(ctx, os.Getenv, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "bench killed relay:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// figureOrder is the order figures run in: those that need the shipping
// service and pkg/inbox last.
var figureOrder = []string{"relay_drain", "relay_drain_wal", "relay_drain_nats", "relay_start_backlog", "hot_aggregate", "relay_recovery", "write_overhead", "read_flat", "claim_flat", "status_scrape", "inbox_throughput", "audit", "e2e_latency", "e2e_latency_wal", "e2e_rate_sweep"}

// config holds the sizes of one run.
type config struct {
	reps         int
	drainBacklog int
	// startBacklog is the backlog relay_start_backlog starts the relays on.
	startBacklog int
	// recoveryBacklog is the backlog relay_recovery drains.
	recoveryBacklog int
	rawWindow       int
	queueType       string
	writeOrders     int
	e2eRate         int
	e2eDuration     time.Duration
	e2eWarmup       time.Duration
	e2eDrainWait    time.Duration
	claimRetained   int
	claimChurn      int
	claimMeasure    time.Duration
	claimRate       int
	inboxMessages   int
	inboxClients    int
	relayBatch      int
	relayWorkers    int
	// relayVacuumEvery is RelayConfig.VacuumEvery (0: auto, the service's).
	relayVacuumEvery int

	// auditEvents is how many events the audit figure audits.
	auditEvents int

	// sweepStartRate is e2e_rate_sweep's first rate (orders/s), sweepStage
	// each stage's length, sweepStages the most stages of a sweep.
	sweepStartRate int
	sweepStage     time.Duration
	sweepStages    int

	// cpuProfileDir (BENCH_CPUPROFILE), when set, receives a CPU profile of
	// each measured drain of the relay figures.
	cpuProfileDir string

	// readOrders and readBaseOrders are the table sizes read_flat compares,
	// readRequests the GETs it times on each.
	readOrders, readBaseOrders, readRequests int
}

func defaultConfig() config {
	return config{
		reps:            3,
		drainBacklog:    100_000,
		startBacklog:    1_000_000,
		recoveryBacklog: 10_000,
		rawWindow:       1000,
		queueType:       "quorum",
		writeOrders:     4000,
		e2eRate:         150,
		e2eDuration:     20 * time.Second,
		e2eWarmup:       2 * time.Second,
		e2eDrainWait:    30 * time.Second,
		claimRetained:   1_000_000,
		claimChurn:      200_000,
		claimMeasure:    10 * time.Second,
		claimRate:       500,
		inboxMessages:   1000,
		inboxClients:    8,
		auditEvents:     1_000_000,
		sweepStartRate:  100,
		sweepStage:      5 * time.Second,
		sweepStages:     10,

		readOrders:     1_000_000,
		readBaseOrders: 1000,
		readRequests:   5000,
	}
}

// quickConfig shrinks every size, to check the harness in a minute.
func quickConfig() config {
	c := defaultConfig()
	c.reps = 1
	c.drainBacklog = 10_000
	c.startBacklog = 50_000
	c.recoveryBacklog = 3000
	c.writeOrders = 500
	c.readOrders = 100_000
	c.readRequests = 500
	c.e2eDuration = 5 * time.Second
	c.e2eWarmup = time.Second
	c.e2eDrainWait = 15 * time.Second
	c.claimRetained = 100_000
	c.claimChurn = 20_000
	c.claimMeasure = 3 * time.Second
	c.inboxMessages = 500
	c.auditEvents = 20_000
	c.sweepStage = 2 * time.Second
	c.sweepStages = 6
	return c
}

// bench is one run.
type bench struct {
	cfg   config
	env   *env
	log   *slog.Logger // the benchmark's progress
	quiet *slog.Logger // the libraries' logs: warnings and errors only
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	only := fs.String("only", "", "comma-separated figures to run (default all): "+strings.Join(figureOrder, ","))
	quick := fs.Bool("quick", false, "small sizes, to check the harness quickly")
	if err := fs.Parse(args); err != nil {
		return err
	}
	selected, err := selectFigures(*only)
	if err != nil {
		return err
	}
	cfg := defaultConfig()
	if *quick {
		cfg = quickConfig()
	}
	if v := getenv("BENCH_REPS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 20 {
			return fmt.Errorf("BENCH_REPS=%q: want 1 to 20", v)
		}
		cfg.reps = n
	}
	for _, v := range []struct {
		name string
		dst  *int
	}{{"BENCH_RELAY_BATCH_SIZE", &cfg.relayBatch}, {"BENCH_RELAY_WORKERS", &cfg.relayWorkers}, {"BENCH_AUDIT_EVENTS", &cfg.auditEvents},
		{"BENCH_SWEEP_START_RATE", &cfg.sweepStartRate}} {
		if s := getenv(v.name); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 1 {
				return fmt.Errorf("%s=%q: want a positive integer", v.name, s)
			}
			*v.dst = n
		}
	}
	if s := getenv("BENCH_RELAY_VACUUM_EVERY"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < -1 {
			return fmt.Errorf("BENCH_RELAY_VACUUM_EVERY=%q: want -1 (never), 0 (auto) or a number of rows", s)
		}
		cfg.relayVacuumEvery = n
	}
	if s := getenv("BENCH_SWEEP_STAGE_SECONDS"); s != "" {
		n, err := strconv.ParseFloat(s, 64)
		if err != nil || n < 0.5 || n > 600 {
			return fmt.Errorf("BENCH_SWEEP_STAGE_SECONDS=%q: want 0.5 to 600", s)
		}
		cfg.sweepStage = time.Duration(n * float64(time.Second))
	}
	if dir := getenv("BENCH_CPUPROFILE"); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("BENCH_CPUPROFILE: %w", err)
		}
		cfg.cpuProfileDir = dir
	}
	out := cmp.Or(getenv("BENCH_OUT"), "bench-results.json")
	databaseURL := cmp.Or(getenv("BENCH_DATABASE_URL"), getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	amqpURL := cmp.Or(getenv("BENCH_AMQP_URL"), getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")

	root, err := moduleRoot()
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	var node *rabbitnode.Running
	switch v := getenv("BENCH_BROKER"); v {
	case "":
	case "private":
		if node, err = rabbitnode.Start(ctx, "bench"); err != nil {
			return fmt.Errorf("BENCH_BROKER=private: %w", err)
		}
		defer func() {
			if err := node.Close(); err != nil {
				log.Warn("stop the run's RabbitMQ node", "error", err)
			}
		}()
		amqpURL = node.URL()
		log.Info("a RabbitMQ node of the run's own", "node", node.Name, "url", redact(amqpURL))
	default:
		return fmt.Errorf("BENCH_BROKER=%q: want private or nothing", v)
	}
	e := newEnv(databaseURL, amqpURL, root, log)
	if node != nil {
		e.rabbitNode = node.Name
	}
	e.keep = getenv("BENCH_KEEP") == "1"
	b := &bench{
		cfg:   cfg,
		env:   e,
		log:   log,
		quiet: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}

	report := Report{StartedAt: time.Now().UTC()}
	report.Machine = describeMachine(ctx, databaseURL, amqpURL)
	if node != nil {
		report.Machine.RabbitMQ += " (a node of the run's own, BENCH_BROKER=private)"
	}
	runErr := b.runFigures(ctx, selected, &report)
	if err := b.env.close(); err != nil {
		runErr = errors.Join(runErr, err)
	}
	if m, err := b.env.ferretVersion(); err == nil && m != "" {
		report.Machine.FerretDB = m
	}
	report.DurationSeconds = round(time.Since(report.StartedAt).Seconds())

	fmt.Fprintf(stdout, "\nmachine: %s\n\n", report.Machine.summary())
	if err := writeTable(stdout, report); err != nil {
		return err
	}
	if err := writeJSON(out, report); err != nil {
		return errors.Join(runErr, err)
	}
	fmt.Fprintf(stdout, "\nwrote %s (%.0fs)\n", out, report.DurationSeconds)
	return runErr
}

// runFigures runs the selected figures in order. A figure that fails is
// recorded in the report's errors and the run goes on with the next one.
func (b *bench) runFigures(ctx context.Context, selected []string, report *Report) error {
	runners := map[string]func(context.Context) ([]Figure, error){
		"relay_drain":         b.runRelayDrain,
		"relay_drain_wal":     b.runRelayDrainWAL,
		"relay_drain_nats":    b.runRelayDrainNATS,
		"relay_start_backlog": b.runRelayStartBacklog,
		"hot_aggregate":       b.runHotAggregate,
		"relay_recovery":      b.runRelayRecovery,
		"write_overhead":      b.runWriteOverhead,
		"read_flat":           b.runReadFlat,
		"claim_flat":          b.runClaimFlat,
		"status_scrape":       b.runStatusScrape,
		"inbox_throughput":    b.runInboxThroughput,
		"audit":               b.runAudit,
		"e2e_latency":         b.runE2ELatency,
		"e2e_latency_wal":     b.runE2ELatencyWAL,
		"e2e_rate_sweep":      b.runE2ERateSweep,
	}
	var failed []string
	for _, name := range selected {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		start, loadStart := time.Now(), load1()
		b.log.Info("figure started", "figure", name)
		figs, err := runners[name](ctx)
		loadEnd := load1()
		if err != nil {
			b.log.Error("figure failed", "figure", name, "error", err)
			report.Errors = append(report.Errors, name+": "+err.Error())
			failed = append(failed, name)
			continue
		}
		b.log.Info("figure done", "figure", name, "seconds", int(time.Since(start).Seconds()))
		for i := range figs {
			figs[i].Load1Start, figs[i].Load1End = cmp.Or(figs[i].Load1Start, loadStart), cmp.Or(figs[i].Load1End, loadEnd)
		}
		report.Figures = append(report.Figures, figs...)
	}
	if len(failed) > 0 {
		return fmt.Errorf("figures failed: %s", strings.Join(failed, ", "))
	}
	return nil
}

func selectFigures(only string) ([]string, error) {
	if only == "" {
		return figureOrder, nil
	}
	want := map[string]bool{}
	for _, s := range strings.Split(only, ",") {
		s = strings.TrimSpace(s)
		if !slices.Contains(figureOrder, s) {
			return nil, fmt.Errorf("-only: unknown figure %q (have %s)", s, strings.Join(figureOrder, ", "))
		}
		want[s] = true
	}
	var out []string
	for _, s := range figureOrder {
		if want[s] {
			out = append(out, s)
		}
	}
	return out, nil
}

// relayConfig is the relay as the orders service configures it by default
// (services/orders/relay.go with internal/config's defaults), with the
// batch size and worker count overridable for tuning.
func (b *bench) relayConfig() outbox.RelayConfig {
	return outbox.RelayConfig{
		BatchSize:       cmp.Or(b.cfg.relayBatch, 500),
		Workers:         b.cfg.relayWorkers, // 0: the library's default
		VacuumEvery:     b.cfg.relayVacuumEvery,
		PollInterval:    time.Second,
		Lease:           30 * time.Second,
		PublishTimeout:  10 * time.Second,
		MaxAttempts:     10,
		RetryBackoffMin: time.Second,
		RetryBackoffMax: 5 * time.Minute,
		Logger:          b.quiet,
	}
}

func (b *bench) relayConfigText() string {
	c := b.relayConfig()
	workers := "default"
	if c.Workers > 0 {
		workers = strconv.Itoa(c.Workers)
	}
	vacuum := "auto"
	switch {
	case c.VacuumEvery < 0:
		vacuum = "never"
	case c.VacuumEvery > 0:
		vacuum = strconv.Itoa(c.VacuumEvery)
	}
	return fmt.Sprintf("BatchSize=%d Workers=%s PollInterval=%v VacuumEvery=%s", c.BatchSize, workers, c.PollInterval, vacuum)
}

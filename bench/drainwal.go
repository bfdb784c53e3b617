package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// walRelayConfig is the WAL relay's configuration in the benchmark: the
// library's defaults, with the polling relay's batch size and attempts.
func (b *bench) walRelayConfig(slot string) outboxwal.Config {
	return outboxwal.Config{
		Slot:        slot,
		Publication: slot,
		BatchSize:   b.relayConfig().BatchSize,
		Workers:     b.cfg.relayWorkers, // 0: the library's default
		MaxAttempts: b.relayConfig().MaxAttempts,
		Logger:      b.quiet,
	}
}

// walSlotName is a slot name for purpose, unique to this run.
func (b *bench) walSlotName(purpose string) string {
	return strings.ToLower("bench_" + b.env.runID + "_" + purpose)
}

// slotDropper returns a function that drops the slot and its publication
// (missing ones are no error), also called when the run ends: a database
// with a slot cannot be dropped, and a slot left behind keeps WAL on the
// server forever.
func (b *bench) slotDropper(poolCfg *pgxpool.Config, slot string) func() error {
	drop := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.ConnectConfig(ctx, poolCfg.ConnConfig.Copy())
		if err != nil {
			return fmt.Errorf("drop slot %s: %w", slot, err)
		}
		defer conn.Close(context.Background())
		for ctx.Err() == nil {
			if err = outboxwal.Drop(ctx, conn, slot, slot); err == nil {
				return nil
			}
			time.Sleep(200 * time.Millisecond) // a stopped relay's walsender is still exiting
		}
		return err
	}
	b.env.onClose("replication slot "+slot, func(context.Context) error { return drop() })
	return drop
}

// sweepTimer times the WAL relay's sweep statements (outbox.StatementOf
// recognises them).
type sweepTimer struct {
	mu    sync.Mutex
	total time.Duration
	count int
}

type sweepKey struct{}

func (t *sweepTimer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if outbox.StatementOf(d.SQL) == outbox.StatementSweep {
		return context.WithValue(ctx, sweepKey{}, time.Now())
	}
	return ctx
}

func (t *sweepTimer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if at, ok := ctx.Value(sweepKey{}).(time.Time); ok && d.Err == nil {
		t.mu.Lock()
		t.total += time.Since(at)
		t.count++
		t.mu.Unlock()
	}
}

// drainWAL prepares the slot, seeds n events (after the slot, so they are in
// its stream), then runs one WAL relay until every row was swept, and
// returns the time from its start to the n-th row swept.
//
// It also returns the CPU the parties spent over the same interval (the
// seeding and the slot's creation excluded); label names its profile.
func (b *bench) drainWAL(ctx context.Context, poolCfg *pgxpool.Config, pool *pgxpool.Pool, url, slot string, n int, timer *sweepTimer, meter *cpuMeter, label string) (time.Duration, cpuUse, error) {
	return b.drainWALSeeded(ctx, poolCfg, pool, url, slot, n, seedPendingOrders, timer, meter, label)
}

// drainWALSeeded is drainWAL with the backlog written by seed.
func (b *bench) drainWALSeeded(ctx context.Context, poolCfg *pgxpool.Config, pool *pgxpool.Pool, url, slot string, n int,
	seed func(context.Context, *pgxpool.Pool, int) error, timer *sweepTimer, meter *cpuMeter, label string) (time.Duration, cpuUse, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pc := poolCfg.Copy()
	pc.ConnConfig.Tracer = timer
	rpool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return 0, cpuUse{}, fmt.Errorf("relay pool: %w", err)
	}
	defer rpool.Close()
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: url, Exchange: exchange, ConnectionName: "bench-relay-wal",
		MaxInFlight: 4 * b.relayConfig().BatchSize, Logger: b.quiet})
	if err != nil {
		return 0, cpuUse{}, err
	}
	defer pub.Close()

	var (
		swept  atomic.Int64
		doneAt atomic.Int64
		done   = make(chan struct{})
		once   sync.Once
	)
	cfg := b.walRelayConfig(slot)
	cfg.Observer = outbox.ObserverFunc(func(_ context.Context, o outbox.Observation) {
		if o.Kind != outboxwal.KindSwept {
			return
		}
		if swept.Add(int64(o.N)) >= int64(n) {
			once.Do(func() {
				doneAt.Store(time.Now().UnixNano())
				close(done)
			})
		}
	})
	relay, err := outboxwal.NewRelay(rpool, untraced(pub), cfg)
	if err != nil {
		return 0, cpuUse{}, err
	}
	pctx, pcancel := context.WithTimeout(ctx, time.Minute)
	err = relay.Prepare(pctx)
	pcancel()
	if err != nil {
		return 0, cpuUse{}, err
	}
	if err := (seedDirect{pool}).reset(ctx); err != nil {
		return 0, cpuUse{}, err
	}
	if err := seed(ctx, pool, n); err != nil {
		return 0, cpuUse{}, err
	}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	err = pub.WaitReady(wctx)
	wcancel()
	if err != nil {
		return 0, cpuUse{}, fmt.Errorf("relay connect: %w", err)
	}
	if err := rpool.Ping(ctx); err != nil {
		return 0, cpuUse{}, err
	}
	iv, err := meter.start(ctx, label)
	if err != nil {
		return 0, cpuUse{}, err
	}
	start := time.Now()
	var wg sync.WaitGroup
	wg.Go(func() { _ = relay.Run(ctx) })
	select {
	case <-done:
	case <-ctx.Done():
	case <-time.After(5 * time.Minute):
	}
	cpu, cpuErr := iv.stop(ctx, n) // before the relay stops and its WAL sender exits
	cancel()
	wg.Wait()
	if swept.Load() < int64(n) {
		return 0, cpuUse{}, fmt.Errorf("only %d of %d events published and swept before the deadline (%v)", swept.Load(), n, ctx.Err())
	}
	if cpuErr != nil {
		return 0, cpuUse{}, fmt.Errorf("CPU per event: %w", cpuErr)
	}
	return time.Duration(doneAt.Load() - start.UnixNano()), cpu, nil
}

// runRelayDrainWAL measures relay_drain_wal: the WAL relay (one) draining a
// backlog of the same events as relay_drain, against the same raw baseline,
// with the polling relay (one) measured in the same repetition.
func (b *bench) runRelayDrainWAL(ctx context.Context) ([]Figure, error) {
	poolCfg, pool, err := b.env.openDatabase(ctx, "drainwal", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	var level string
	if err := pool.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		return nil, err
	}
	if level != "logical" {
		return nil, fmt.Errorf("wal_level=%s: the WAL relay needs logical (deploy/local/ensure-services.sh sets it)", level)
	}
	url, err := b.env.newVhost(ctx, "drainwal")
	if err != nil {
		return nil, err
	}
	if err := declareDrainTopology(url, b.cfg.queueType); err != nil {
		return nil, err
	}
	slot := b.walSlotName("drainwal")
	dropSlot := b.slotDropper(poolCfg, slot)

	n := b.cfg.drainBacklog
	check := func(what string) error {
		pending, inQueue, err := pendingAndQueued(ctx, pool, url)
		if err != nil {
			return err
		}
		if what == "baseline" {
			pending = 0
		}
		// At least once: a batch confirmed as the relay stopped may be in the queue twice.
		if pending != 0 || inQueue < n {
			return fmt.Errorf("%s: after the drain outbox=%d queue=%d, want 0 and %d", what, pending, inQueue, n)
		}
		return nil
	}
	seed := func() error { return (seedDirect{pool}).freshBacklog(ctx, n) }

	meter := newCPUMeter(ctx, pool, url, b.cfg.cpuProfileDir)
	var raw, wal, poll []float64
	var rawCPU, walCPUs, pollCPUs []cpuUse
	details := map[string]any{}
	for rep := range b.cfg.reps {
		if err := seed(); err != nil {
			return nil, err
		}
		d, baseCPU, _, err := rawBaseline(ctx, pool, url, b.cfg.rawWindow, meter, fmt.Sprintf("relay_drain_wal_raw_rep%d", rep))
		if err != nil {
			return nil, err
		}
		if err := check("baseline"); err != nil {
			return nil, err
		}
		raw = append(raw, rate(n, d))

		// The polling relay, one, on the same backlog: the comparison of the same run.
		if err := seed(); err != nil {
			return nil, err
		}
		res, err := drainWithRelays(ctx, poolCfg, amqpPublishers(url, b.quiet), n, 1, b.relayConfig(), b.quiet, meter, fmt.Sprintf("relay_drain_wal_poll_rep%d", rep))
		if err != nil {
			return nil, fmt.Errorf("polling relay: %w", err)
		}
		if _, err := takeQueue(url, drainQueueName); err != nil {
			return nil, err
		}
		poll = append(poll, rate(n, res.elapsed))

		timer := &sweepTimer{}
		wd, walCPU, err := b.drainWAL(ctx, poolCfg, pool, url, slot, n, timer, meter, fmt.Sprintf("relay_drain_wal_rep%d", rep))
		if err != nil {
			return nil, fmt.Errorf("WAL relay: %w", err)
		}
		if err := check("WAL relay"); err != nil {
			return nil, err
		}
		// A fresh slot per repetition: the next one's seeding for the baseline
		// and the polling relay would be in this slot's stream.
		if err := dropSlot(); err != nil {
			return nil, fmt.Errorf("drop slot %s: %w", slot, err)
		}
		wal = append(wal, rate(n, wd))
		rawCPU, pollCPUs, walCPUs = append(rawCPU, baseCPU), append(pollCPUs, res.cpu), append(walCPUs, walCPU)
		sweepUS := 0.0
		if n > 0 {
			sweepUS = round(float64(timer.total.Microseconds()) / float64(n))
		}
		details[fmt.Sprintf("rep_%d", rep)] = map[string]any{
			"baseline_events_per_s": int(rate(n, d)), "baseline_cpu_per_event": baseCPU.perEvent(),
			"poll_events_per_s": int(rate(n, res.elapsed)), "poll_cpu_per_event": res.cpu.perEvent(),
			"wal_events_per_s": int(rate(n, wd)), "wal_cpu_per_event": walCPU.perEvent(),
			"wal_sweep_statements": timer.count, "wal_sweep_wall_us_per_event": sweepUS,
		}
		b.log.Info("relay_drain_wal", "rep", rep, "baseline_events_per_s", int(rate(n, d)),
			"poll_events_per_s", int(rate(n, res.elapsed)), "wal_events_per_s", int(rate(n, wd)), "sweep_us_per_event", sweepUS,
			"baseline_cpu_us_per_event", baseCPU.perEvent(), "poll_cpu_us_per_event", res.cpu.perEvent(), "wal_cpu_us_per_event", walCPU.perEvent())
	}
	details["baseline_events_per_s"] = raw
	details["poll_events_per_s"] = poll
	details["wal_events_per_s"] = wal
	details["backlog"] = n
	details["repetitions"] = b.cfg.reps
	details["queue_type"] = b.cfg.queueType
	details["table_size"] = "rows of confirmed events deleted in one statement per sweep (every 100ms, up to 10,000 rows)"

	base := median(raw)
	measures := fmt.Sprintf("events/s of one WAL relay (pkg/outbox/outboxwal) draining a backlog of %d order.created events, from its start to the last row swept (median of %d runs)", n, b.cfg.reps)
	baseIs := fmt.Sprintf("amqp091-go alone publishing the same %d messages with %d confirms in flight, to the same exchange and %s queue", n, b.cfg.rawWindow, b.cfg.queueType)
	figs := []Figure{newFigure("relay_drain_wal", "events/s", median(wal), base, Goal{RatioAtLeast, 0.8}, measures, baseIs, details)}
	figs = append(figs, cpuFigures("relay_drain_wal", walCPUs, rawCPU, "one WAL relay draining the backlog",
		"the raw publisher of the baseline (in the benchmark's process)", meter.unmeasured)...)
	figs = append(figs, newFigure("relay_drain_wal_vs_poll", "events/s", median(wal), median(poll), Goal{RatioAtLeast, 1},
		"the same WAL relay figure", "one polling relay (pkg/outbox) draining the same backlog in the same repetitions", nil))
	figs = append(figs, cpuFigures("relay_drain_wal_vs_poll", walCPUs, pollCPUs, "one WAL relay draining the backlog",
		"one polling relay draining the same backlog in the same repetitions", meter.unmeasured)...)
	return figs, nil
}

// startWALRelay starts a WAL relay on a pool of its own, with a slot of its
// own, and returns once it streams; stop drops the slot.
func (b *bench) startWALRelay(ctx context.Context, poolCfg *pgxpool.Config, url, slot string) (*runningRelay, error) {
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg.Copy())
	if err != nil {
		return nil, fmt.Errorf("relay pool: %w", err)
	}
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: url, Exchange: exchange, ConnectionName: "bench-relay-wal",
		MaxInFlight: 4 * b.relayConfig().BatchSize, Logger: b.quiet})
	if err != nil {
		pool.Close()
		return nil, err
	}
	relay, err := outboxwal.NewRelay(pool, untraced(pub), b.walRelayConfig(slot))
	if err != nil {
		_ = pub.Close()
		pool.Close()
		return nil, err
	}
	drop := b.slotDropper(poolCfg, slot)
	rctx, cancel := context.WithCancel(ctx)
	r := &runningRelay{relay: relay, pool: pool, pub: pub, cancel: cancel, after: func() {
		if err := drop(); err != nil {
			b.log.Warn("drop the WAL relay's slot", "slot", slot, "error", err)
		}
	}}
	r.wg.Go(func() { _ = relay.Run(rctx) })
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	if err := pub.WaitReady(wctx); err != nil {
		r.stop()
		return nil, fmt.Errorf("relay connect: %w", err)
	}
	for !relay.Stats().Active {
		if wctx.Err() != nil {
			r.stop()
			return nil, errors.New("the WAL relay did not start streaming within 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return r, nil
}

// runE2ELatencyWAL measures e2e_latency_wal: e2e_latency's path (an order's
// commit to its shipment applied by the shipping service) with the WAL relay,
// against the polling relay woken in-process after each commit (its fastest
// path), in the same run.
func (b *bench) runE2ELatencyWAL(ctx context.Context) ([]Figure, error) {
	tmp, err := os.MkdirTemp("", "bench-e2e-wal-")
	if err != nil {
		return nil, err
	}
	b.env.onClose("e2e temp dir "+tmp, func(context.Context) error { return os.RemoveAll(tmp) })
	bin, err := b.buildShipping(ctx, tmp)
	if err != nil {
		return nil, err
	}
	poolCfg, pool, err := b.env.openDatabase(ctx, "e2ewal", b.migrateOrders)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	details := map[string]any{"rate_per_s": b.cfg.e2eRate, "seconds": b.cfg.e2eDuration.Seconds(),
		"drain_wait_seconds": b.cfg.e2eDrainWait.Seconds(), "instrument": instrumentText}
	applied := map[string]Latencies{}
	for _, v := range []e2eVariant{{name: "wal", wal: true}, {name: "wake", wake: true}} {
		res, err := b.measureE2E(ctx, bin, tmp, poolCfg, pool, v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.name, err)
		}
		a, err := summarize(res.applied)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.name, err)
		}
		applied[v.name] = a
		details[v.name] = map[string]any{"orders": a.N, "not_applied_within_wait": res.late,
			"applied_p50_ms": ms(a.P50), "applied_p90_ms": ms(a.P90), "applied_p99_ms": ms(a.P99), "applied_max_ms": ms(a.Max),
			"instrument": res.instrument()}
		b.log.Info("e2e_latency_wal", "variant", v.name, "tail", res.tail, "applied_p50_ms", ms(a.P50), "applied_p99_ms", ms(a.P99), "late", res.late)
	}
	what := fmt.Sprintf("latency from an order's commit to its shipment applied by the shipping service, %d orders/s for %v, WAL relay (pkg/outbox/outboxwal)", b.cfg.e2eRate, b.cfg.e2eDuration)
	baseIs := "the same with the polling relay woken in-process after each commit (e2e_latency_wake)"
	wal, wake := applied["wal"], applied["wake"]
	return []Figure{
		newFigure("e2e_latency_wal_p50", "ms", ms(wal.P50), ms(wake.P50), Goal{}, "p50 "+what, baseIs, details),
		newFigure("e2e_latency_wal_p99", "ms", ms(wal.P99), ms(wake.P99), Goal{ValueAtMost, 25}, "p99 "+what, baseIs, nil),
	}, nil
}

package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// confirmCounter passes batches to a publisher and counts the confirmed
// messages, noting when the first and the n-th were confirmed.
type confirmCounter struct {
	outbox.Publisher
	n         int64
	start     time.Time
	confirmed atomic.Int64
	firstAt   atomic.Int64 // unix nanos
	doneAt    atomic.Int64
	done      chan struct{}
	once      sync.Once
}

func newConfirmCounter(pub outbox.Publisher, n int) *confirmCounter {
	return &confirmCounter{Publisher: pub, n: int64(n), done: make(chan struct{})}
}

func (c *confirmCounter) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	errs := c.Publisher.PublishBatch(ctx, msgs)
	var ok int64
	for _, err := range errs {
		if err == nil {
			ok++
		}
	}
	if ok > 0 {
		now := time.Now().UnixNano()
		c.firstAt.CompareAndSwap(0, now)
		if c.confirmed.Add(ok) >= c.n {
			c.once.Do(func() {
				c.doneAt.Store(now)
				close(c.done)
			})
		}
	}
	return errs
}

// runRelayStartBacklog measures relay_start_backlog: each relay started on an
// outbox holding startBacklog pending events (a first start on a busy table,
// a restart after an outage): how long until it publishes its first event,
// and its drain rate over the whole backlog against its own rate on
// relay_drain's backlog, measured in the same run.
func (b *bench) runRelayStartBacklog(ctx context.Context) ([]Figure, error) {
	poolCfg, pool, err := b.env.openDatabase(ctx, "startbacklog", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	url, err := b.env.newVhost(ctx, "startbacklog")
	if err != nil {
		return nil, err
	}
	if err := declareDrainTopology(url, b.cfg.queueType); err != nil {
		return nil, err
	}
	seed := func(n int) error { return (seedDirect{pool}).freshBacklog(ctx, n) }
	big, small := b.cfg.startBacklog, b.cfg.drainBacklog
	meter := newCPUMeter(ctx, pool, url, b.cfg.cpuProfileDir)
	var figs []Figure
	for _, mode := range []string{"poll", "wal"} {
		slot := b.walSlotName("startbacklog")
		dropSlot := b.slotDropper(poolCfg, slot)
		run := func(n int) (first, all time.Duration, cpu cpuUse, err error) {
			defer func() {
				if _, qerr := takeQueue(url, drainQueueName); qerr != nil && err == nil {
					err = qerr
				}
				if mode == "wal" {
					if derr := dropSlot(); derr != nil && err == nil {
						err = derr
					}
				}
			}()
			if err := seed(n); err != nil {
				return 0, 0, cpuUse{}, err
			}
			return b.startOnBacklog(ctx, poolCfg, url, mode, slot, n, meter, fmt.Sprintf("relay_start_backlog_%s_%d", mode, n))
		}
		// Its own rate on relay_drain's backlog first, as relay_drain and
		// relay_drain_wal measure it (the WAL relay's slot made before the
		// backlog is written: it streams it), then the big one.
		var smallAll time.Duration
		var smallCPU cpuUse
		if mode == "poll" {
			_, smallAll, smallCPU, err = run(small)
		} else {
			smallAll, smallCPU, err = b.drainWAL(ctx, poolCfg, pool, url, slot, small, &sweepTimer{}, meter, "relay_start_backlog_wal_baseline")
			if err == nil {
				err = dropSlot()
			}
			if err == nil {
				_, err = takeQueue(url, drainQueueName)
			}
		}
		if err != nil {
			return nil, fmt.Errorf("%s relay, %d rows: %w", mode, small, err)
		}
		first, bigAll, bigCPU, err := run(big)
		if err != nil {
			return nil, fmt.Errorf("%s relay, %d rows: %w", mode, big, err)
		}
		smallRate, bigRate := rate(small, smallAll), rate(big, bigAll)
		b.log.Info("relay_start_backlog", "relay", mode, "rows", big, "first_publish_s", first.Seconds(),
			"events_per_s", int(bigRate), "events_per_s_on_relay_drain_backlog", int(smallRate),
			"cpu_us_per_event", bigCPU.perEvent(), "cpu_us_per_event_on_relay_drain_backlog", smallCPU.perEvent())
		name := "relay_start_backlog_" + mode
		what := map[string]string{"poll": "one polling relay (pkg/outbox)", "wal": "one WAL relay (pkg/outbox/outboxwal), making its slot and handing the backlog over to polling"}[mode]
		details := map[string]any{"backlog": big, "baseline_backlog": small, "drained_in_s": round(bigAll.Seconds())}
		figs = append(figs,
			newFigure(name+"_first_publish", "s", first.Seconds(), 0, Goal{ValueAtMost, 10},
				fmt.Sprintf("seconds from the start of %s on an outbox of %d pending events to its first confirmed publish", what, big), "", details),
			newFigure(name, "events/s", bigRate, smallRate, Goal{RatioAtLeast, 0.8},
				fmt.Sprintf("events/s of %s draining %d pending events, from its start to the last confirm", what, big),
				fmt.Sprintf("the same relay draining relay_drain's backlog of %d events in the same run, as relay_drain (polling) or relay_drain_wal (WAL: streamed) measure it", small), nil))
		figs = append(figs, cpuFigures(name, []cpuUse{bigCPU}, []cpuUse{smallCPU},
			fmt.Sprintf("%s draining %d pending events", what, big),
			fmt.Sprintf("the same relay draining relay_drain's backlog of %d events", small), meter.unmeasured)...)
	}
	return figs, nil
}

// startOnBacklog starts one relay of mode ("poll" or "wal") on the seeded
// backlog of n events and returns the time from its start to its first
// confirmed publish and to the n-th, and what that cost (the meter's
// interval label, from the start to the n-th confirm).
func (b *bench) startOnBacklog(ctx context.Context, poolCfg *pgxpool.Config, url, mode, slot string, n int, meter *cpuMeter, label string) (first, all time.Duration, cpu cpuUse, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	rpool, err := pgxpool.NewWithConfig(ctx, poolCfg.Copy())
	if err != nil {
		return 0, 0, cpuUse{}, fmt.Errorf("relay pool: %w", err)
	}
	defer rpool.Close()
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: url, Exchange: exchange, ConnectionName: "bench-start-backlog",
		MaxInFlight: 4 * b.relayConfig().BatchSize, Logger: b.quiet})
	if err != nil {
		return 0, 0, cpuUse{}, err
	}
	defer pub.Close()
	counter := newConfirmCounter(untraced(pub), n)
	var runner interface{ Run(context.Context) error }
	switch mode {
	case "poll":
		cfg := b.relayConfig()
		cfg.Logger = b.quiet
		runner, err = outbox.NewRelay(rpool, counter, cfg)
	default:
		cfg := b.walRelayConfig(slot)
		runner, err = outboxwal.NewRelay(rpool, counter, cfg)
	}
	if err != nil {
		return 0, 0, cpuUse{}, err
	}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	err = pub.WaitReady(wctx)
	wcancel()
	if err != nil {
		return 0, 0, cpuUse{}, fmt.Errorf("relay connect: %w", err)
	}
	iv, err := meter.start(ctx, label)
	if err != nil {
		return 0, 0, cpuUse{}, err
	}
	start := time.Now()
	var wg sync.WaitGroup
	wg.Go(func() { _ = runner.Run(ctx) })
	select {
	case <-counter.done:
	case <-ctx.Done():
	case <-time.After(15 * time.Minute):
	}
	cpu, cpuErr := iv.stop(ctx, n) // before the relay stops and its WAL sender exits
	cancel()
	wg.Wait()
	if counter.confirmed.Load() < int64(n) {
		return 0, 0, cpuUse{}, fmt.Errorf("only %d of %d events confirmed before the deadline", counter.confirmed.Load(), n)
	}
	if cpuErr != nil {
		return 0, 0, cpuUse{}, fmt.Errorf("CPU per event: %w", cpuErr)
	}
	return time.Duration(counter.firstAt.Load() - start.UnixNano()), time.Duration(counter.doneAt.Load() - start.UnixNano()), cpu, nil
}

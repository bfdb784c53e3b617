package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// declareDrainTopology declares the exchange the relay publishes to and one
// durable queue bound to every routing key, with no consumer, so every
// publish is routed and stored.
func declareDrainTopology(url, queueType string) error {
	conn, err := amqp.Dial(url)
	if err != nil {
		return fmt.Errorf("dial broker: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange: %w", err)
	}
	if _, err := ch.QueueDeclare(drainQueueName, true, false, false, false, amqp.Table{"x-queue-type": queueType}); err != nil {
		return fmt.Errorf("declare queue: %w", err)
	}
	if err := ch.QueueBind(drainQueueName, "order.*", exchange, false, nil); err != nil {
		return fmt.Errorf("bind queue: %w", err)
	}
	return nil
}

// pendingAndQueued returns, after a drain, the rows left in the outbox and
// the messages the drain queue holds (which it then purges).
func pendingAndQueued(ctx context.Context, pool *pgxpool.Pool, url string) (pending, queued int, err error) {
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&pending); err != nil {
		return 0, 0, err
	}
	queued, err = takeQueue(url, drainQueueName)
	return pending, queued, err
}

// takeQueue returns how many messages the queue holds, then purges it.
func takeQueue(url, queue string) (int, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return 0, fmt.Errorf("dial broker: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("open channel: %w", err)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("inspect queue %s: %w", queue, err)
	}
	if _, err := ch.QueuePurge(queue, false); err != nil {
		return 0, fmt.Errorf("purge queue %s: %w", queue, err)
	}
	return q.Messages, nil
}

// rawPublish is the baseline: amqp091-go alone publishing msgs (persistent,
// mandatory) on one confirm-mode channel with up to window confirms in
// flight. It returns the time from the first publish to the last confirm.
func rawPublish(ctx context.Context, url string, msgs []amqp.Publishing, window int) (time.Duration, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return 0, fmt.Errorf("dial broker: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return 0, fmt.Errorf("confirm mode: %w", err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, window))
	var returned atomic.Int64
	returns := ch.NotifyReturn(make(chan amqp.Return, 64))
	returnsDone := make(chan struct{})
	go func() {
		defer close(returnsDone)
		for range returns {
			returned.Add(1)
		}
	}()

	timeout := time.NewTimer(2 * time.Minute)
	defer timeout.Stop()
	var nacked int
	await := func() error {
		select {
		case c, ok := <-confirms:
			if !ok {
				return errors.New("channel closed while awaiting confirms")
			}
			if !c.Ack {
				nacked++
			}
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-timeout.C:
			return errors.New("confirms did not arrive within 2 minutes")
		}
	}

	start := time.Now()
	inflight := 0
	for _, m := range msgs {
		for inflight >= window {
			if err := await(); err != nil {
				return 0, err
			}
			inflight--
		}
		if err := ch.PublishWithContext(ctx, exchange, m.Type, true, false, m); err != nil {
			return 0, fmt.Errorf("publish: %w", err)
		}
		inflight++
	}
	for ; inflight > 0; inflight-- {
		if err := await(); err != nil {
			return 0, err
		}
	}
	elapsed := time.Since(start)
	_ = ch.Close()
	<-returnsDone
	if nacked > 0 || returned.Load() > 0 {
		return 0, fmt.Errorf("baseline publish: %d nacked, %d returned", nacked, returned.Load())
	}
	return elapsed, nil
}

// drainResult is what a relay drain observed.
type drainResult struct {
	elapsed time.Duration
	batches int
	claims  []time.Duration
	marks   []time.Duration
	cpu     cpuUse // over the same interval, when a meter was given
}

// relayPublisher is a relay's publisher, closed after its drain.
type relayPublisher interface {
	outbox.Publisher
	Close() error
}

// newRelayPublisher returns relay i's publisher.
type newRelayPublisher func(i int) (relayPublisher, error)

// amqpPublishers makes each relay an outboxamqp publisher of its own to the
// broker at url.
func amqpPublishers(url string, log *slog.Logger) newRelayPublisher {
	return func(i int) (relayPublisher, error) {
		return outboxamqp.NewPublisher(outboxamqp.Config{URL: url, Exchange: exchange, ConnectionName: fmt.Sprintf("bench-relay-%d", i), Logger: log})
	}
}

// drainWithRelays runs relays relays (each with its own pool and broker
// connection, as separate processes would have) against a backlog of n rows
// and returns the time from their start until the n-th row was marked
// published. With a meter, it also reads the CPU the parties spent over
// that interval (label names its profile).
func drainWithRelays(ctx context.Context, poolCfg *pgxpool.Config, newPub newRelayPublisher, n, relays int, cfg outbox.RelayConfig, log *slog.Logger, meter *cpuMeter, label string) (drainResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	var (
		published atomic.Int64
		batches   atomic.Int64
		doneAt    atomic.Int64 // unix nanos
		done      = make(chan struct{})
		doneOnce  sync.Once
		failMu    sync.Mutex
		failure   error
	)
	cfg.Logger = log
	// KindPublished comes after the mark of the rows it counts; any
	// failure, dead letter, unmarked row or failed mark fails the drain.
	cfg.Observer = outbox.ObserverFunc(func(_ context.Context, o outbox.Observation) {
		switch o.Kind {
		case outbox.KindBatchDuration:
			batches.Add(1)
			return
		case outbox.KindFailed, outbox.KindDeadLettered, outbox.KindUnmarked, outbox.KindMarkFailed, outbox.KindClaimFailed:
			failMu.Lock()
			failure = errors.Join(failure, fmt.Errorf("relay reported %s (%d)", o.Kind, o.N))
			failMu.Unlock()
			return
		case outbox.KindPublished:
		default:
			return
		}
		if published.Add(int64(o.N)) >= int64(n) {
			doneOnce.Do(func() {
				doneAt.Store(time.Now().UnixNano())
				close(done)
			})
		}
	})

	timer := newSQLTimer()
	type instance struct {
		pool  *pgxpool.Pool
		pub   relayPublisher
		relay *outbox.Relay
	}
	var insts []instance
	defer func() {
		for _, in := range insts {
			_ = in.pub.Close()
			in.pool.Close()
		}
	}()
	for i := range relays {
		pc := poolCfg.Copy()
		pc.ConnConfig.Tracer = timer
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			return drainResult{}, fmt.Errorf("relay %d pool: %w", i, err)
		}
		pub, err := newPub(i)
		if err != nil {
			pool.Close()
			return drainResult{}, err
		}
		relay, err := outbox.NewRelay(pool, untraced(pub), cfg)
		if err != nil {
			_ = pub.Close()
			pool.Close()
			return drainResult{}, err
		}
		insts = append(insts, instance{pool, pub, relay})
		// Connect before the clock starts, as the baseline does.
		rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
		err = pub.WaitReady(rctx)
		rcancel()
		if err != nil {
			return drainResult{}, fmt.Errorf("relay %d connect: %w", i, err)
		}
		if err := pool.Ping(ctx); err != nil {
			return drainResult{}, fmt.Errorf("relay %d ping: %w", i, err)
		}
	}

	var iv *cpuInterval
	if meter != nil {
		var err error
		if iv, err = meter.start(ctx, label); err != nil {
			return drainResult{}, err
		}
	}
	timer.start()
	start := time.Now()
	var wg sync.WaitGroup
	for _, in := range insts {
		wg.Go(func() { _ = in.relay.Run(ctx) })
	}
	select {
	case <-done:
	case <-ctx.Done():
	case <-time.After(5 * time.Minute):
	}
	var (
		cpu    cpuUse
		cpuErr error
	)
	if iv != nil { // before the relays stop and their connections close
		cpu, cpuErr = iv.stop(ctx, n)
	}
	cancel()
	wg.Wait()
	recorded := timer.stop()
	claims, marks := recorded["claim"], recorded["batch"]
	if published.Load() < int64(n) {
		return drainResult{}, fmt.Errorf("only %d of %d events published before the deadline (%v)", published.Load(), n, errors.Join(failure, ctx.Err()))
	}
	if failure != nil {
		return drainResult{}, failure
	}
	if cpuErr != nil {
		return drainResult{}, fmt.Errorf("CPU per event: %w", cpuErr)
	}
	return drainResult{
		cpu:     cpu,
		elapsed: time.Duration(doneAt.Load() - start.UnixNano()),
		batches: int(batches.Load()),
		claims:  claims,
		marks:   marks,
	}, nil
}

// migrateOutbox applies the outbox schema alone (figures without orders).
func migrateOutbox(ctx context.Context, pool *pgxpool.Pool) error { return outbox.Migrate(ctx, pool) }

// runRelayDrain measures relay_drain: a backlog of backlog events drained by
// one relay and by three, against amqp091-go publishing the same messages.
func (b *bench) runRelayDrain(ctx context.Context) ([]Figure, error) {
	poolCfg, pool, err := b.env.openDatabase(ctx, "drain", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	url, err := b.env.newVhost(ctx, "drain")
	if err != nil {
		return nil, err
	}
	if err := declareDrainTopology(url, b.cfg.queueType); err != nil {
		return nil, err
	}

	n := b.cfg.drainBacklog
	seed := func() error { return (seedDirect{pool}).freshBacklog(ctx, n) }
	check := func(what string) error {
		var pending, moved int
		if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox_published)").Scan(&pending, &moved); err != nil {
			return err
		}
		inQueue, err := takeQueue(url, drainQueueName)
		if err != nil {
			return err
		}
		if what == "baseline" {
			pending, moved = 0, n
		}
		if pending != 0 || moved != n || inQueue != n {
			return fmt.Errorf("%s: after the drain outbox=%d published=%d queue=%d, want 0, %d, %d", what, pending, moved, inQueue, n, n)
		}
		return nil
	}

	meter := newCPUMeter(ctx, pool, url, b.cfg.cpuProfileDir)
	var raw, one, three []float64
	var rawCPU, oneCPU, threeCPU []cpuUse
	details := map[string]any{}
	for rep := range b.cfg.reps {
		// Baseline: the same messages, read back from the seeded outbox.
		if err := seed(); err != nil {
			return nil, err
		}
		d, cpu, avgBody, err := rawBaseline(ctx, pool, url, b.cfg.rawWindow, meter, fmt.Sprintf("relay_drain_raw_rep%d", rep))
		if err != nil {
			return nil, err
		}
		details["message_body_bytes_avg"] = avgBody
		details[fmt.Sprintf("baseline_rep_%d", rep)] = map[string]any{"events_per_s": int(rate(n, d)), "cpu_per_event": cpu.perEvent()}
		if err := check("baseline"); err != nil {
			return nil, err
		}
		raw = append(raw, rate(n, d))
		rawCPU = append(rawCPU, cpu)
		b.log.Info("relay_drain baseline", "rep", rep, "events_per_s", int(rate(n, d)), "cpu_us_per_event", cpu.perEvent())

		for _, relays := range []int{1, 3} {
			if err := seed(); err != nil {
				return nil, err
			}
			res, err := drainWithRelays(ctx, poolCfg, amqpPublishers(url, b.quiet), n, relays, b.relayConfig(), b.quiet, meter, fmt.Sprintf("relay_drain_%d_rep%d", relays, rep))
			if err != nil {
				return nil, fmt.Errorf("%d relay(s): %w", relays, err)
			}
			if err := check(fmt.Sprintf("%d relay(s)", relays)); err != nil {
				return nil, err
			}
			r := rate(n, res.elapsed)
			claims, _ := summarize(res.claims)
			marks, _ := summarize(res.marks)
			key := fmt.Sprintf("relays_%d_rep_%d", relays, rep)
			details[key] = map[string]any{
				"events_per_s": int(r), "batches": res.batches,
				"claim_ms_p50": ms(claims.P50), "claim_ms_p99": ms(claims.P99),
				"mark_ms_p50": ms(marks.P50), "mark_ms_p99": ms(marks.P99),
				"cpu_per_event": res.cpu.perEvent(),
			}
			if relays == 1 {
				one = append(one, r)
				oneCPU = append(oneCPU, res.cpu)
			} else {
				three = append(three, r)
				threeCPU = append(threeCPU, res.cpu)
			}
			b.log.Info("relay_drain", "relays", relays, "rep", rep, "events_per_s", int(r), "batches", res.batches, "cpu_us_per_event", res.cpu.perEvent())
		}
	}
	details["baseline_events_per_s"] = raw
	details["relays_1_events_per_s"] = one
	details["relays_3_events_per_s"] = three
	details["backlog"] = n
	details["repetitions"] = b.cfg.reps
	details["queue_type"] = b.cfg.queueType
	details["relay_config"] = b.relayConfigText()

	base := median(raw)
	measures := fmt.Sprintf("events/s draining a backlog of %d order.created events (median of %d runs)", n, b.cfg.reps)
	baseIs := fmt.Sprintf("amqp091-go alone publishing the same %d messages (persistent, mandatory, same headers) with %d confirms in flight, to the same exchange and %s queue", n, b.cfg.rawWindow, b.cfg.queueType)
	rawIs := "the raw publisher of the baseline (in the benchmark's process)"
	figs := []Figure{newFigure("relay_drain_1_relay", "events/s", median(one), base, Goal{RatioAtLeast, 0.8}, "one relay: "+measures, baseIs, details)}
	figs = append(figs, cpuFigures("relay_drain_1_relay", oneCPU, rawCPU, "one relay draining the backlog", rawIs, meter.unmeasured)...)
	figs = append(figs, newFigure("relay_drain_3_relays", "events/s", median(three), base, Goal{RatioAtLeast, 0.8}, "three relays: "+measures, baseIs, nil))
	figs = append(figs, cpuFigures("relay_drain_3_relays", threeCPU, rawCPU, "three relays (one process) draining the backlog", rawIs, meter.unmeasured)...)
	return figs, nil
}

// rawBaseline reads the seeded backlog back from the outbox and publishes it
// straight to url as the relay would (outboxamqp.Publishing): the baseline a
// drain is measured against. It returns the time and the CPU that took, and
// the payloads' average size.
func rawBaseline(ctx context.Context, pool *pgxpool.Pool, url string, window int, meter *cpuMeter, label string) (time.Duration, cpuUse, int, error) {
	envs, err := loadEnvelopes(ctx, pool)
	if err != nil {
		return 0, cpuUse{}, 0, err
	}
	msgs := make([]amqp.Publishing, len(envs))
	size := 0
	for i, e := range envs {
		msgs[i] = outboxamqp.Publishing(e)
		size += len(e.Payload)
	}
	d, cpu, err := rawPublishMeasured(ctx, url, msgs, window, meter, label)
	if err != nil {
		return 0, cpuUse{}, 0, fmt.Errorf("baseline: %w", err)
	}
	return d, cpu, size / max(1, len(envs)), nil
}

// rawPublishMeasured is rawPublish with the CPU the parties spent over it
// (its connection's opening included: a few milliseconds of the broker's
// CPU over the whole backlog).
func rawPublishMeasured(ctx context.Context, url string, msgs []amqp.Publishing, window int, meter *cpuMeter, label string) (time.Duration, cpuUse, error) {
	iv, err := meter.start(ctx, label)
	if err != nil {
		return 0, cpuUse{}, err
	}
	d, err := rawPublish(ctx, url, msgs, window)
	cpu, cpuErr := iv.stop(ctx, len(msgs))
	if err != nil {
		return 0, cpuUse{}, err
	}
	if cpuErr != nil {
		return 0, cpuUse{}, fmt.Errorf("CPU per event: %w", cpuErr)
	}
	return d, cpu, nil
}

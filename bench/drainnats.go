package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxnats"
)

// natsServer returns the NATS server relay_drain_nats publishes to:
// BENCH_NATS_URL, or one with JetStream run in the benchmark's process, on
// a free port with a store of its own, stopped by the returned function.
func (b *bench) natsServer() (url string, stop func(), err error) {
	if u := os.Getenv("BENCH_NATS_URL"); u != "" {
		return u, func() {}, nil
	}
	dir, err := os.MkdirTemp("", "bench-nats-")
	if err != nil {
		return "", nil, err
	}
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		_ = os.RemoveAll(dir)
		return "", nil, fmt.Errorf("nats-server: %w", err)
	}
	s.Start()
	stop = func() {
		s.Shutdown()
		s.WaitForShutdown()
		_ = os.RemoveAll(dir)
	}
	if !s.ReadyForConnections(10 * time.Second) {
		stop()
		return "", nil, errors.New("nats-server not ready within 10s")
	}
	return s.ClientURL(), stop, nil
}

// freshStream replaces the run's stream with an empty one capturing
// prefix.> (file storage, one replica), so that each drain starts without
// messages or remembered message ids.
func freshStream(ctx context.Context, js jetstream.JetStream, name, prefix string) error {
	if err := js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("delete stream: %w", err)
	}
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{prefix + ".>"}, Storage: jetstream.FileStorage})
	if err != nil {
		return fmt.Errorf("create stream: %w", err)
	}
	return nil
}

// rawJetStreamPublish is the baseline: nats.go alone publishing msgs with
// the asynchronous JetStream publish on one connection, with up to window
// acknowledgements awaited at once. It returns the time from the first
// publish to the last acknowledgement.
func rawJetStreamPublish(ctx context.Context, url string, msgs []*nats.Msg, window int) (time.Duration, error) {
	nc, err := nats.Connect(url, nats.Name("bench-raw"))
	if err != nil {
		return 0, fmt.Errorf("connect: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(window))
	if err != nil {
		return 0, err
	}
	futures := make([]jetstream.PubAckFuture, 0, len(msgs))
	start := time.Now()
	for _, m := range msgs {
		f, err := js.PublishMsgAsync(m, jetstream.WithStallWait(2*time.Minute))
		if err != nil {
			return 0, fmt.Errorf("publish: %w", err)
		}
		futures = append(futures, f)
	}
	timeout := time.NewTimer(2 * time.Minute)
	defer timeout.Stop()
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return 0, fmt.Errorf("baseline publish: %w", err)
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-timeout.C:
			return 0, errors.New("acknowledgements did not arrive within 2 minutes")
		}
	}
	return time.Since(start), nil
}

// runRelayDrainNATS measures relay_drain_nats: one polling relay draining
// a backlog to NATS JetStream through outboxnats, against nats.go alone
// publishing the same messages with acknowledgements.
func (b *bench) runRelayDrainNATS(ctx context.Context) ([]Figure, error) {
	poolCfg, pool, err := b.env.openDatabase(ctx, "drain_nats", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	url, stopServer, err := b.natsServer()
	if err != nil {
		return nil, err
	}
	defer stopServer()
	nc, err := nats.Connect(url, nats.Name("bench-admin"))
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", url, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	stream, prefix := "BENCH_"+b.env.runID, "bench_"+b.env.runID
	defer func() { _ = js.DeleteStream(context.WithoutCancel(ctx), stream) }()
	newPub := func(int) (relayPublisher, error) {
		return outboxnats.NewPublisher(outboxnats.Config{URL: url, SubjectPrefix: prefix, MaxInFlight: b.cfg.rawWindow * 4, Logger: b.quiet})
	}
	// The baseline's messages are the publisher's own.
	shape, err := outboxnats.NewPublisher(outboxnats.Config{URL: url, SubjectPrefix: prefix})
	if err != nil {
		return nil, err
	}
	defer shape.Close()

	// The CPU instrument, without RabbitMQ (not in this figure): the
	// relay's group is the benchmark's process, which also runs the NATS
	// server when BENCH_NATS_URL is unset, in the relay's drain and in the
	// baseline alike.
	meter := newCPUMeter(ctx, pool, "", b.cfg.cpuProfileDir)
	if os.Getenv("BENCH_NATS_URL") != "" {
		meter.unmeasured["nats"] = "the NATS server of BENCH_NATS_URL is another process: its CPU is not read"
	}

	n := b.cfg.drainBacklog
	check := func(what string) error {
		var pending int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&pending); err != nil {
			return err
		}
		info, err := js.Stream(ctx, stream)
		if err != nil {
			return err
		}
		if what == "baseline" {
			pending = 0
		}
		if msgs := info.CachedInfo().State.Msgs; pending != 0 || msgs != uint64(n) {
			return fmt.Errorf("%s: after the drain outbox=%d stream=%d, want 0 and %d", what, pending, msgs, n)
		}
		return nil
	}
	var raw, one []float64
	var rawCPU, oneCPU []cpuUse
	details := map[string]any{}
	for rep := range b.cfg.reps {
		if err := (seedDirect{pool}).freshBacklog(ctx, n); err != nil {
			return nil, err
		}
		envs, err := loadEnvelopes(ctx, pool)
		if err != nil {
			return nil, err
		}
		msgs := make([]*nats.Msg, len(envs))
		for i, e := range envs {
			if msgs[i], err = shape.Message(e); err != nil {
				return nil, err
			}
			msgs[i].Header.Set(jetstream.MsgIDHeader, e.MessageID())
		}
		if err := freshStream(ctx, js, stream, prefix); err != nil {
			return nil, err
		}
		iv, err := meter.start(ctx, fmt.Sprintf("relay_drain_nats_raw_rep%d", rep))
		if err != nil {
			return nil, err
		}
		d, err := rawJetStreamPublish(ctx, url, msgs, b.cfg.rawWindow)
		cpu, cpuErr := iv.stop(ctx, n)
		if err != nil {
			return nil, fmt.Errorf("baseline: %w", err)
		}
		if cpuErr != nil {
			return nil, fmt.Errorf("baseline's CPU per event: %w", cpuErr)
		}
		rawCPU = append(rawCPU, cpu)
		if err := check("baseline"); err != nil {
			return nil, err
		}
		raw = append(raw, rate(n, d))
		b.log.Info("relay_drain_nats baseline", "rep", rep, "events_per_s", int(rate(n, d)))

		if err := (seedDirect{pool}).freshBacklog(ctx, n); err != nil {
			return nil, err
		}
		if err := freshStream(ctx, js, stream, prefix); err != nil {
			return nil, err
		}
		res, err := drainWithRelays(ctx, poolCfg, newPub, n, 1, b.relayConfig(), b.quiet, meter, fmt.Sprintf("relay_drain_nats_rep%d", rep))
		if err != nil {
			return nil, fmt.Errorf("relay: %w", err)
		}
		if err := check("relay"); err != nil {
			return nil, err
		}
		r := rate(n, res.elapsed)
		one = append(one, r)
		oneCPU = append(oneCPU, res.cpu)
		details[fmt.Sprintf("rep_%d", rep)] = map[string]any{"baseline_events_per_s": int(rate(n, d)), "relay_events_per_s": int(r), "batches": res.batches,
			"cpu_per_event": res.cpu.perEvent(), "baseline_cpu_per_event": cpu.perEvent()}
		b.log.Info("relay_drain_nats", "rep", rep, "events_per_s", int(r), "batches", res.batches, "cpu_us_per_event", res.cpu.perEvent())
	}
	details["baseline_events_per_s"] = raw
	details["relay_events_per_s"] = one
	details["backlog"] = n
	details["repetitions"] = b.cfg.reps
	details["relay_config"] = b.relayConfigText()
	if os.Getenv("BENCH_NATS_URL") == "" {
		details["server"] = "nats-server " + server.VERSION + " with JetStream (file storage) in the benchmark's process"
	}
	measures := fmt.Sprintf("events/s of one polling relay draining a backlog of %d order.created events to NATS JetStream through outboxnats (median of %d runs)", n, b.cfg.reps)
	baseIs := fmt.Sprintf("nats.go alone publishing the same %d messages (same subjects, headers and Nats-Msg-Id) with the asynchronous JetStream publish, %d acknowledgements awaited at once, to the same stream", n, b.cfg.rawWindow)
	figs := []Figure{newFigure("relay_drain_nats", "events/s", median(one), median(raw), Goal{RatioAtLeast, 0.8}, measures, baseIs, details)}
	return append(figs, cpuFigures("relay_drain_nats", oneCPU, rawCPU, "one polling relay draining the backlog to JetStream (the benchmark's process runs the NATS server too)", baseIs, meter.unmeasured)...), nil
}

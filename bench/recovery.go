package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// The relay process relay_recovery kills is this binary, started again with
// killedRelayEnv set: it runs one relay whose batches block once the broker
// confirmed them, before their mark, and prints how many rows it has in
// flight, until the figure sends it SIGKILL.
const (
	killedRelayEnv    = "BENCH_KILLED_RELAY"
	killedRelayDBURL  = "BENCH_KILLED_RELAY_DATABASE_URL"
	killedRelayDBName = "BENCH_KILLED_RELAY_DATABASE"
	killedRelayAMQP   = "BENCH_KILLED_RELAY_AMQP_URL"
	killedRelayBatch  = "BENCH_KILLED_RELAY_BATCH_SIZE"
	killedRelayLease  = 4 * time.Second
)

// runKilledRelay is the killed relay's process: see killedRelayEnv.
func runKilledRelay(ctx context.Context, getenv func(string) string, stdout io.Writer) error {
	pcfg, err := pgxpool.ParseConfig(getenv(killedRelayDBURL))
	if err != nil {
		return fmt.Errorf("killed relay: database URL: %w", err)
	}
	pcfg.ConnConfig.Database = getenv(killedRelayDBName)
	batch, err := strconv.Atoi(getenv(killedRelayBatch))
	if err != nil {
		return fmt.Errorf("killed relay: batch size: %w", err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: getenv(killedRelayAMQP), Exchange: exchange, ConnectionName: "bench-killed-relay", Logger: log})
	if err != nil {
		return err
	}
	defer pub.Close()
	var (
		mu       sync.Mutex
		inFlight int
	)
	// Once the broker confirmed a batch, before the relay marks it, the
	// relay reports the rows and stops there until the SIGKILL.
	held := afterConfirm{Publisher: pub, confirmed: func(n int) {
		mu.Lock()
		inFlight += n
		fmt.Fprintf(stdout, "in_flight %d\n", inFlight)
		mu.Unlock()
		<-ctx.Done() // until SIGKILL
	}}
	relay, err := outbox.NewRelay(pool, held, outbox.RelayConfig{
		BatchSize: batch, Workers: 2, PollInterval: 10 * time.Millisecond, VacuumEvery: -1,
		Lease: killedRelayLease, PublishTimeout: killedRelayLease / 2, Logger: log,
	})
	if err != nil {
		return err
	}
	return relay.Run(ctx)
}

// afterConfirm calls confirmed with the number of messages of a batch the
// broker confirmed, if any, before handing the verdicts back to the relay.
type afterConfirm struct {
	outbox.Publisher
	confirmed func(n int)
}

func (p afterConfirm) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	errs := p.Publisher.PublishBatch(ctx, msgs)
	n := 0
	for _, err := range errs {
		if err == nil {
			n++
		}
	}
	if n > 0 {
		p.confirmed(n)
	}
	return errs
}

// killRelayWithRowsInFlight starts the killed relay's process on the
// figure's database and broker, waits until its two workers have want rows
// confirmed by the broker and not marked, SIGKILLs it, and waits until their
// lease has ended. It returns how many rows the process left in flight.
func (b *bench) killRelayWithRowsInFlight(ctx context.Context, pool *pgxpool.Pool, dbName, amqpURL string, want int) (int, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, exe)
	cmd.Env = append(os.Environ(), killedRelayEnv+"=1",
		killedRelayDBURL+"="+b.env.databaseURL, killedRelayDBName+"="+dbName,
		killedRelayAMQP+"="+amqpURL, killedRelayBatch+"="+strconv.Itoa(want/2))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("start the relay to kill: %w", err)
	}
	reported := 0
	sc := bufio.NewScanner(out)
	for reported < want && sc.Scan() {
		if n, ok := strings.CutPrefix(sc.Text(), "in_flight "); ok {
			reported, _ = strconv.Atoi(n)
		}
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_, _ = io.Copy(io.Discard, out)
	waitErr := cmd.Wait()
	if reported < want {
		return 0, fmt.Errorf("the relay to kill reported %d rows in flight, want %d (%v)", reported, want, errors.Join(sc.Err(), waitErr, cctx.Err()))
	}
	var inFlight int
	var leaseEnd time.Time
	if err := pool.QueryRow(ctx, "SELECT count(*), coalesce(max(leased_until), now()) FROM outbox WHERE in_flight").Scan(&inFlight, &leaseEnd); err != nil {
		return 0, err
	}
	if inFlight < want {
		return 0, fmt.Errorf("the killed relay left %d rows in flight, want %d", inFlight, want)
	}
	select {
	case <-time.After(time.Until(leaseEnd) + 100*time.Millisecond):
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	return inFlight, nil
}

// runRelayRecovery measures relay_recovery: one relay draining a backlog
// that a SIGKILLed relay left with rows in flight (its two full batches,
// published and not marked), against the same relay draining the same
// backlog with nothing in flight, in the same run.
func (b *bench) runRelayRecovery(ctx context.Context) ([]Figure, error) {
	poolCfg, pool, err := b.env.openDatabase(ctx, "recovery", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	url, err := b.env.newVhost(ctx, "recovery")
	if err != nil {
		return nil, err
	}
	if err := declareDrainTopology(url, b.cfg.queueType); err != nil {
		return nil, err
	}

	n := b.cfg.recoveryBacklog
	cfg := b.relayConfig()
	killedInFlight := 2 * cfg.BatchSize // the killed relay's two workers, a full batch each
	seed := func() error {
		if err := (seedDirect{pool}).reset(ctx); err != nil {
			return err
		}
		if err := (seedDirect{pool}).pendingOrders(ctx, n); err != nil {
			return err
		}
		_, err := pool.Exec(ctx, "ANALYZE outbox, outbox_aggregates")
		return err
	}
	drain := func(what string, duplicates int) (drainResult, error) {
		res, err := drainWithRelays(ctx, poolCfg, amqpPublishers(url, b.quiet), n, 1, cfg, b.quiet, nil, "")
		if err != nil {
			return res, fmt.Errorf("%s: %w", what, err)
		}
		inQueue, err := takeQueue(url, drainQueueName)
		if err != nil {
			return res, err
		}
		var pending int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&pending); err != nil {
			return res, err
		}
		if pending != 0 || inQueue != n+duplicates {
			return res, fmt.Errorf("%s: after the drain outbox=%d queue=%d, want 0 and %d", what, pending, inQueue, n+duplicates)
		}
		return res, nil
	}

	var clean, recovered []float64
	details := map[string]any{}
	for rep := range b.cfg.reps {
		if err := seed(); err != nil {
			return nil, err
		}
		res, err := drain("clean drain", 0)
		if err != nil {
			return nil, err
		}
		clean = append(clean, rate(n, res.elapsed))
		details[fmt.Sprintf("clean_rep_%d", rep)] = map[string]any{"events_per_s": int(rate(n, res.elapsed)), "batches": res.batches}

		if err := seed(); err != nil {
			return nil, err
		}
		left, err := b.killRelayWithRowsInFlight(ctx, pool, poolCfg.ConnConfig.Database, url, killedInFlight)
		if err != nil {
			return nil, err
		}
		if _, err := pool.Exec(ctx, "ANALYZE outbox"); err != nil {
			return nil, err
		}
		// What the killed relay published before its mark is in the queue
		// already: the drain publishes those rows again.
		if _, err := takeQueue(url, drainQueueName); err != nil {
			return nil, err
		}
		res, err = drain("drain after the kill", 0)
		if err != nil {
			return nil, err
		}
		recovered = append(recovered, rate(n, res.elapsed))
		details[fmt.Sprintf("after_kill_rep_%d", rep)] = map[string]any{
			"events_per_s": int(rate(n, res.elapsed)), "batches": res.batches, "rows_in_flight_at_kill": left,
		}
		b.log.Info("relay_recovery", "rep", rep, "clean_events_per_s", int(clean[rep]), "after_kill_events_per_s", int(recovered[rep]),
			"batches", res.batches, "rows_in_flight_at_kill", left)
	}
	details["backlog"] = n
	details["repetitions"] = b.cfg.reps
	details["queue_type"] = b.cfg.queueType
	details["relay_config"] = b.relayConfigText()
	details["clean_events_per_s"] = clean
	details["after_kill_events_per_s"] = recovered

	return []Figure{newFigure("relay_recovery", "events/s", median(recovered), median(clean), Goal{RatioAtLeast, 0.7},
		fmt.Sprintf("events/s of one relay draining a backlog of %d events that a relay SIGKILLed with %d rows in flight (two full batches, confirmed by the broker, not marked) left, from its start once their lease ended (median of %d runs)",
			n, killedInFlight, b.cfg.reps),
		fmt.Sprintf("the same relay draining the same backlog of %d events with nothing in flight, in the same run", n),
		details)}, nil
}

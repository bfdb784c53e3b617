package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// hotBacklog is the events of one aggregate hot_aggregate drains.
const hotBacklog = 1000

// runHotAggregate measures hot_aggregate: one relay publishing a backlog of
// hotBacklog events of one aggregate (an order updated hotBacklog times
// while no relay ran: versions 1 to hotBacklog, each waiting behind the one
// before), against the same relay draining as many events of as many
// aggregates, in the same run. The relay keeps an aggregate's order by
// publishing its next event only once the previous one is confirmed and
// marked, so one aggregate goes at the pace of a claim, a publish, a confirm
// and a mark per event, whatever the batch size.
func (b *bench) runHotAggregate(ctx context.Context) ([]Figure, error) {
	poolCfg, pool, err := b.env.openDatabase(ctx, "hot", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	url, err := b.env.newVhost(ctx, "hot")
	if err != nil {
		return nil, err
	}
	if err := declareDrainTopology(url, b.cfg.queueType); err != nil {
		return nil, err
	}
	n := hotBacklog
	// drain seeds the backlog, drains it with one relay and checks that
	// every event went out once.
	drain := func(what string, seed func(context.Context, *pgxpool.Pool, int) error) (float64, error) {
		if err := (seedDirect{pool}).reset(ctx); err != nil {
			return 0, err
		}
		if err := seed(ctx, pool, n); err != nil {
			return 0, err
		}
		res, err := drainWithRelays(ctx, poolCfg, amqpPublishers(url, b.quiet), n, 1, b.relayConfig(), b.quiet, nil, "hot_aggregate_"+what)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", what, err)
		}
		pending, inQueue, err := pendingAndQueued(ctx, pool, url)
		if err != nil {
			return 0, err
		}
		if pending != 0 || inQueue != n {
			return 0, fmt.Errorf("%s: after the drain outbox=%d queue=%d, want 0, %d", what, pending, inQueue, n)
		}
		return rate(n, res.elapsed), nil
	}

	var many, hot []float64
	details := map[string]any{}
	for rep := range b.cfg.reps {
		r, err := drain(fmt.Sprintf("many_rep%d", rep), seedManyAggregates)
		if err != nil {
			return nil, err
		}
		h, err := drain(fmt.Sprintf("one_rep%d", rep), seedHotAggregate)
		if err != nil {
			return nil, err
		}
		many, hot = append(many, r), append(hot, h)
		b.log.Info("hot_aggregate", "rep", rep, "one_aggregate_events_per_s", int(h), "many_aggregates_events_per_s", int(r))
	}
	writers, err := b.hotWriters(ctx, poolCfg, pool, url)
	if err != nil {
		return nil, err
	}
	walFig, err := b.hotAggregateWAL(ctx, poolCfg, pool, url)
	if err != nil {
		return nil, fmt.Errorf("hot_aggregate_wal: %w", err)
	}
	details["one_aggregate_events_per_s"] = hot
	details["many_aggregates_events_per_s"] = many
	details["backlog"] = n
	details["repetitions"] = b.cfg.reps
	details["relay_config"] = b.relayConfigText()
	return []Figure{newFigure("hot_aggregate", "events/s", median(hot), median(many), Goal{RatioAtLeast, 0.25},
		fmt.Sprintf("events/s of one relay draining a backlog of %d events of one aggregate (versions 1 to %d; median of %d runs)", n, n, b.cfg.reps),
		fmt.Sprintf("the same relay draining %d events of %d aggregates, one each, in the same run", n, n), details), writers, walFig}, nil
}

// hotAggregateWAL measures hot_aggregate_wal: the WAL relay streaming
// hotBacklog events of one aggregate (written after its slot was made, so
// the stream carries them: runs of the aggregate's next events behind its
// head), against the same relay streaming as many events of as many
// aggregates, in the same run.
func (b *bench) hotAggregateWAL(ctx context.Context, poolCfg *pgxpool.Config, pool *pgxpool.Pool, url string) (Figure, error) {
	var level string
	if err := pool.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		return Figure{}, err
	}
	if level != "logical" {
		return Figure{}, fmt.Errorf("wal_level=%s: the WAL relay needs logical (deploy/local/ensure-services.sh sets it)", level)
	}
	n := hotBacklog
	meter := newCPUMeter(ctx, pool, url, b.cfg.cpuProfileDir)
	slot := b.walSlotName("hotwal")
	dropSlot := b.slotDropper(poolCfg, slot)
	drain := func(what string, seed func(context.Context, *pgxpool.Pool, int) error) (float64, error) {
		d, _, err := b.drainWALSeeded(ctx, poolCfg, pool, url, slot, n, seed, &sweepTimer{}, meter, "hot_aggregate_wal_"+what)
		if err == nil {
			err = dropSlot()
		}
		if err != nil {
			return 0, fmt.Errorf("%s: %w", what, err)
		}
		pending, inQueue, err := pendingAndQueued(ctx, pool, url)
		if err != nil {
			return 0, err
		}
		// At least once: a batch confirmed as the relay stopped may be in the queue twice.
		if pending != 0 || inQueue < n {
			return 0, fmt.Errorf("%s: after the drain outbox=%d queue=%d, want 0 and %d", what, pending, inQueue, n)
		}
		return rate(n, d), nil
	}
	var many, hot []float64
	for rep := range b.cfg.reps {
		r, err := drain(fmt.Sprintf("many_rep%d", rep), seedPendingOrders)
		if err != nil {
			return Figure{}, err
		}
		h, err := drain(fmt.Sprintf("one_rep%d", rep), seedHotAggregate)
		if err != nil {
			return Figure{}, err
		}
		many, hot = append(many, r), append(hot, h)
		b.log.Info("hot_aggregate_wal", "rep", rep, "one_aggregate_events_per_s", int(h), "many_aggregates_events_per_s", int(r))
	}
	details := map[string]any{"one_aggregate_events_per_s": hot, "many_aggregates_events_per_s": many, "backlog": n, "repetitions": b.cfg.reps}
	return newFigure("hot_aggregate_wal", "events/s", median(hot), median(many), Goal{RatioAtLeast, 0.5},
		fmt.Sprintf("events/s of one WAL relay streaming %d events of one aggregate, written after its slot was made (median of %d runs)", n, b.cfg.reps),
		fmt.Sprintf("the same relay streaming %d events of %d aggregates, one each, in the same run", n, n), details), nil
}

// Writers of hot_aggregate_writers: back to back on one aggregate, each
// pausing between its transactions.
const (
	hotWriters      = 8
	hotWritersPause = 5 * time.Millisecond
	hotWritersFor   = 10 * time.Second
)

// hotWriters measures hot_aggregate_writers: the events of one aggregate
// the relay published (confirmed and marked) while hotWriters writers wrote
// it back to back for hotWritersFor, per second, against the events they
// wrote per second. Then the rest drains, and the queue must hold every
// event once.
func (b *bench) hotWriters(ctx context.Context, poolCfg *pgxpool.Config, pool *pgxpool.Pool, url string) (Figure, error) {
	if err := (seedDirect{pool}).reset(ctx); err != nil {
		return Figure{}, err
	}
	if _, err := takeQueue(url, drainQueueName); err != nil {
		return Figure{}, err
	}
	relay, err := startRelay(ctx, poolCfg, url, b.relayConfig(), nil)
	if err != nil {
		return Figure{}, err
	}
	defer relay.stop()

	id := newUUID()
	var written atomic.Int64
	stop := time.Now().Add(hotWritersFor)
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, hotWriters)
	for range hotWriters {
		wg.Go(func() {
			for i := 0; time.Now().Before(stop); i++ {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					return outbox.Enqueue(ctx, tx, outbox.Message{AggregateType: aggregateType, AggregateID: id,
						EventType: "order.updated", Payload: createdEvent(id, i, time.Now()), Headers: traceHeaders()})
				})
				if err != nil {
					errs <- fmt.Errorf("hot writer: %w", err)
					return
				}
				written.Add(1)
				relay.relay.Wake()
				time.Sleep(hotWritersPause)
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return Figure{}, err
	}
	elapsed := time.Since(start)
	var published, pending int
	if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM outbox_published), (SELECT count(*) FROM outbox)").Scan(&published, &pending); err != nil {
		return Figure{}, fmt.Errorf("count published events: %w", err)
	}
	drainStart := time.Now()
	if err := waitDrained(ctx, pool, 2*time.Minute); err != nil {
		return Figure{}, err
	}
	drained := time.Since(drainStart)
	n := int(written.Load())
	_, inQueue, err := pendingAndQueued(ctx, pool, url)
	if err != nil {
		return Figure{}, err
	}
	if inQueue < n {
		return Figure{}, fmt.Errorf("hot_aggregate_writers: %d events written, %d in the queue", n, inQueue)
	}
	b.log.Info("hot_aggregate_writers", "written", n, "published_while_writing", published, "pending_when_writers_stopped", pending, "drained_in", drained.Round(time.Millisecond))
	details := map[string]any{
		"writers": hotWriters, "pause_ms": hotWritersPause.Milliseconds(), "seconds": elapsed.Seconds(),
		"written": n, "published_while_writing": published, "pending_when_writers_stopped": pending,
		"rest_drained_in_ms": drained.Milliseconds(), "messages_in_queue": inQueue,
		"relay_config": b.relayConfigText(),
	}
	return newFigure("hot_aggregate_writers", "events/s", rate(published, elapsed), rate(n, elapsed), Goal{RatioAtLeast, 0.9},
		fmt.Sprintf("events of one aggregate published (confirmed and marked) per second while %d writers wrote it back to back (%v pause between a writer's transactions) for %v", hotWriters, hotWritersPause, hotWritersFor),
		"the events per second they wrote, in the same run", details), nil
}

// seedManyAggregates writes n pending order.created events of n orders with
// Enqueue, in one transaction, as seedHotAggregate writes its one order's.
func seedManyAggregates(ctx context.Context, pool *pgxpool.Pool, n int) error {
	if err := enqueueOrders(ctx, pool, n, func() {}); err != nil {
		return fmt.Errorf("seed many aggregates: %w", err)
	}
	_, err := pool.Exec(ctx, "ANALYZE outbox, outbox_aggregates")
	return err
}

// seedHotAggregate writes n pending events of one order with Enqueue, in one
// transaction: versions 1 to n, each but the first waiting behind the one
// before, as n updates of the order leave them while no relay runs.
func seedHotAggregate(ctx context.Context, pool *pgxpool.Pool, n int) error {
	id := newUUID()
	now := time.Now()
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{AggregateType: aggregateType, AggregateID: id, EventType: "order.updated",
			Payload: createdEvent(id, i, now), Headers: traceHeaders()}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, msgs...)
	})
	if err != nil {
		return fmt.Errorf("seed one aggregate: %w", err)
	}
	_, err = pool.Exec(ctx, "ANALYZE outbox, outbox_aggregates")
	return err
}

package main

import (
	"context"
	"fmt"
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
		if err := resetOutbox(ctx, pool); err != nil {
			return 0, err
		}
		if err := seed(ctx, pool, n); err != nil {
			return 0, err
		}
		res, err := drainWithRelays(ctx, poolCfg, url, n, 1, b.relayConfig(), b.quiet, nil, "hot_aggregate_"+what)
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
		r, err := drain(fmt.Sprintf("many_rep%d", rep), seedBacklog)
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
	details["one_aggregate_events_per_s"] = hot
	details["many_aggregates_events_per_s"] = many
	details["backlog"] = n
	details["repetitions"] = b.cfg.reps
	details["relay_config"] = b.relayConfigText()
	return []Figure{newFigure("hot_aggregate", "events/s", median(hot), median(many), Goal{RatioAtLeast, 0.25},
		fmt.Sprintf("events/s of one relay draining a backlog of %d events of one aggregate (versions 1 to %d; median of %d runs)", n, n, b.cfg.reps),
		fmt.Sprintf("the same relay draining %d events of %d aggregates, one each, in the same run", n, n), details)}, nil
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
		_, err := outbox.Enqueue(ctx, tx, msgs...)
		return err
	})
	if err != nil {
		return fmt.Errorf("seed one aggregate: %w", err)
	}
	_, err = pool.Exec(ctx, "ANALYZE outbox, outbox_aggregates")
	return err
}

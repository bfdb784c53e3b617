package outboxaudit_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// An audit reads every event the outbox committed in a window, with where
// each one is: published, still pending, dead-lettered, or discarded by an
// operator. The scan goes by id, one page per statement.
func ExampleEventLog() {
	ctx := context.Background()
	pool, drop, err := outboxtest.NewSchema(ctx, "outboxaudit_example")
	if err != nil {
		log.Fatalf("the example needs PostgreSQL at %s: %v", outboxtest.DatabaseURL(), err)
	}
	defer func() { _ = drop() }()
	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	enqueue := func(aggregateID string) {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, outbox.Message{
				AggregateType: "order", AggregateID: aggregateID, EventType: "order.created", Payload: []byte(`{}`)})
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	enqueue("o-1")
	enqueue("o-2")
	// A relay publishes o-1; the broker refuses o-2, which is dead-lettered.
	rctx, stop := context.WithCancel(ctx)
	relay, err := outbox.NewRelay(pool, refusingPublisher{refuses: []string{"o-2"}}, outbox.RelayConfig{
		MaxAttempts: 1, PollInterval: 10 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()
	admin := outboxadmin.New(pool)
	for s, err := admin.Status(ctx); err != nil || s.Pending > 0 || s.DeadLettered == 0; s, err = admin.Status(ctx) {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	if err := admin.Discard(ctx, 2, "the broker refuses it for good"); err != nil {
		log.Fatal(err)
	}
	enqueue("o-3") // no relay runs now: it stays pending

	events, err := outboxaudit.NewEventLog(pool, 0)
	if err != nil {
		log.Fatal(err)
	}
	for e, err := range events.Events(ctx, outboxaudit.EventWindow{}) {
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(e.ID, e.State)
	}
	found, err := events.Lookup(ctx, []int64{3, 99})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("lookup 3 and 99:", len(found), "found:", found[0].ID, found[0].State)
	// Output:
	// 1 published
	// 2 discarded
	// 3 pending
	// lookup 3 and 99: 1 found: 3 pending
}

// refusingPublisher takes every message but those of the aggregates it
// refuses.
type refusingPublisher struct{ refuses []string }

func (refusingPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p refusingPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if slices.Contains(p.refuses, m.AggregateID) {
			errs[i] = errors.New("refused by the broker")
		}
	}
	return errs
}

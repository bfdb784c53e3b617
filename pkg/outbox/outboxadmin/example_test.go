package outboxadmin_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// brokenPublisher fails every message while broken is set.
type brokenPublisher struct{ broken atomic.Bool }

func (p *brokenPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p *brokenPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	errs := make([]error, len(msgs))
	for i := range msgs {
		if p.broken.Load() {
			errs[i] = errors.New("schema registry rejected the payload")
		}
	}
	return errs
}

// An event that keeps failing is dead-lettered after MaxAttempts and waits,
// visible, until an operator retries it once the cause is fixed.
func ExampleAdmin_Retry() {
	ctx := context.Background()
	pool, dropSchema := exampleDB()
	defer dropSchema()
	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, outbox.Message{
			AggregateType: "order", AggregateID: "o-7", EventType: "order.created", Payload: []byte(`{}`)})
	})
	if err != nil {
		log.Fatal(err)
	}

	pub := &brokenPublisher{}
	pub.broken.Store(true)
	runRelayUntil(pool, pub, outbox.KindDeadLettered)

	admin := outboxadmin.New(pool)
	dead, err := admin.DeadLetters(ctx, 0, 100)
	if err != nil {
		log.Fatal(err)
	}
	for _, d := range dead {
		fmt.Printf("dead letter id=%d %s/%s v%d attempts=%d last_error=%q\n",
			d.ID, d.AggregateType, d.AggregateID, d.AggregateVersion, d.Attempts, d.LastError)
	}

	pub.broken.Store(false) // the cause is fixed
	if err := admin.Retry(ctx, dead[0].ID); err != nil {
		log.Fatal(err)
	}
	runRelayUntil(pool, pub, outbox.KindPublished)

	status, err := admin.Status(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("pending=%d dead_lettered=%d\n", status.Pending, status.DeadLettered)
	// Output:
	// dead letter id=1 order/o-7 v1 attempts=2 last_error="schema registry rejected the payload"
	// pending=0 dead_lettered=0
}

// schemaRegistry accepts every event but the ones it rejects, and prints what
// it publishes.
type schemaRegistry struct{ rejects string }

func (p *schemaRegistry) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p *schemaRegistry) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if m.EventType == p.rejects {
			errs[i] = errors.New("schema registry rejected the payload")
			fmt.Printf("rejected %s/%s v%d %s\n", m.AggregateType, m.AggregateID, m.AggregateVersion, m.EventType)
			continue
		}
		fmt.Printf("published %s/%s v%d %s\n", m.AggregateType, m.AggregateID, m.AggregateVersion, m.EventType)
	}
	return errs
}

// An event that can never be published holds back the later events of its
// aggregate until an operator discards it: it is kept in outbox_discarded
// with the reason, and the aggregate's next events go out.
//
// The event's first attempt takes the next one along, in the same batch
// (a run): the broker takes it, but it is not marked, because the event
// before it failed. Its retries go alone. Once it is discarded, the next
// event goes out again, now in its turn; a consumer that checks versions
// dropped the early copy.
func ExampleAdmin_Discard() {
	ctx := context.Background()
	pool, dropSchema := exampleDB()
	defer dropSchema()
	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx,
			outbox.Message{AggregateType: "order", AggregateID: "o-7", EventType: "order.created", Payload: []byte(`{"v": 0}`)},
			outbox.Message{AggregateType: "order", AggregateID: "o-7", EventType: "order.paid", Payload: []byte(`{}`)})
	})
	if err != nil {
		log.Fatal(err)
	}

	pub := &schemaRegistry{rejects: "order.created"}
	runRelayUntil(pool, pub, outbox.KindDeadLettered)

	admin := outboxadmin.New(pool)
	dead, err := admin.DeadLetters(ctx, 0, 100)
	if err != nil {
		log.Fatal(err)
	}
	if err := admin.Discard(ctx, dead[0].ID, "payload v0 is no longer accepted; the order was re-sent by hand"); err != nil {
		log.Fatal(err)
	}
	runRelayUntil(pool, pub, outbox.KindPublished)

	var event, reason string
	if err := pool.QueryRow(ctx, "SELECT event_type, reason FROM outbox_discarded").Scan(&event, &reason); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("discarded %s: %s\n", event, reason)
	// Output:
	// rejected order/o-7 v1 order.created
	// published order/o-7 v2 order.paid
	// rejected order/o-7 v1 order.created
	// published order/o-7 v2 order.paid
	// discarded order.created: payload v0 is no longer accepted; the order was re-sent by hand
}

// runRelayUntil runs a relay until it reports an observation of kind.
func runRelayUntil(pool *pgxpool.Pool, pub outbox.Publisher, kind outbox.ObservationKind) {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{
		MaxAttempts:     2,
		RetryBackoffMin: 10 * time.Millisecond,
		RetryBackoffMax: 10 * time.Millisecond,
		PollInterval:    10 * time.Millisecond,
		Logger:          slog.New(slog.DiscardHandler),
		Observer: outbox.ObserverFunc(func(_ context.Context, o outbox.Observation) {
			if o.Kind == kind {
				stop()
			}
		}),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

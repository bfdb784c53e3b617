package outbox_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// printPublisher is the smallest Publisher: it "publishes" by printing, and
// stops the example's relay after a number of messages. A real one (see
// outboxamqp) returns nil for a message only once the broker confirmed it.
type printPublisher struct {
	mu   sync.Mutex
	left int
	stop context.CancelFunc
}

func (p *printPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p *printPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		fmt.Printf("publish id=%d %s/%s v%d %s %s\n", m.ID, m.AggregateType, m.AggregateID, m.AggregateVersion, m.EventType, m.Payload)
		if p.left--; p.left == 0 {
			p.stop()
		}
	}
	return make([]error, len(msgs)) // all confirmed
}

// Write events in the business transaction, then let a relay publish them:
// each aggregate's events in order, at least once.
func Example() {
	ctx := context.Background()
	pool, dropSchema := exampleDB() // a pool on an empty schema
	defer dropSchema()

	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}

	// Write side: the events commit with the business change, or not at all.
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... INSERT INTO orders ... in the same transaction ...
		return outbox.Enqueue(ctx, tx,
			outbox.Message{AggregateType: "order", AggregateID: "o-1", EventType: "order.created", Payload: []byte(`{"order_id":"o-1"}`)},
			outbox.Message{AggregateType: "order", AggregateID: "o-2", EventType: "order.created", Payload: []byte(`{"order_id":"o-2"}`)},
		)
	})
	if err != nil {
		log.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx,
			outbox.Message{AggregateType: "order", AggregateID: "o-1", EventType: "order.cancelled", Payload: []byte(`{"order_id":"o-1"}`)})
	})
	if err != nil {
		log.Fatal(err)
	}

	// Read side: the relay publishes until its context ends (here, when the
	// publisher has seen the three events), then finishes its batch and returns.
	runCtx, stop := context.WithCancel(ctx)
	relay, err := outbox.NewRelay(pool, &printPublisher{left: 3, stop: stop}, outbox.RelayConfig{
		Workers: 1,
		Logger:  slog.New(slog.DiscardHandler),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(runCtx); err != nil {
		log.Fatal(err)
	}

	status, err := outboxadmin.New(pool).Status(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("pending=%d dead_lettered=%d\n", status.Pending, status.DeadLettered)
	// Output:
	// publish id=1 order/o-1 v1 order.created {"order_id": "o-1"}
	// publish id=3 order/o-1 v2 order.cancelled {"order_id": "o-1"}
	// publish id=2 order/o-2 v1 order.created {"order_id": "o-2"}
	// pending=0 dead_lettered=0
}

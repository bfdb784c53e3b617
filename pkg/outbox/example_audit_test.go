package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// refusingPublisher confirms every event but those of one aggregate.
type refusingPublisher struct{ refuses string }

func (p refusingPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p refusingPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if m.AggregateID == p.refuses {
			errs[i] = errors.New("refused by the broker")
		}
	}
	return errs
}

// An audit reads every event the outbox committed in a window, with where
// each one is: published, still pending, dead-lettered, or discarded by an
// operator. The scan goes by id, one page per statement.
func ExampleEventLog() {
	ctx := context.Background()
	pool, dropSchema := exampleDB()
	defer dropSchema()
	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	enqueue := func(aggregateID string) {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := outbox.Enqueue(ctx, tx, outbox.Message{
				AggregateType: "order", AggregateID: aggregateID, EventType: "order.created", Payload: []byte(`{}`)})
			return err
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	enqueue("o-1")
	enqueue("o-2")
	var published, dead atomic.Int64
	runRelayUntil(pool, refusingPublisher{refuses: "o-2"}, func(r outbox.BatchResult) bool {
		p, d := published.Add(int64(len(r.Published))), dead.Add(int64(len(r.DeadLettered)))
		return p > 0 && d > 0
	})
	if err := outbox.NewAdmin(pool).Discard(ctx, 2, "the broker refuses it for good"); err != nil {
		log.Fatal(err)
	}
	enqueue("o-3") // no relay runs now: it stays pending

	events, err := outbox.NewEventLog(pool, 0)
	if err != nil {
		log.Fatal(err)
	}
	for e, err := range events.Events(ctx, outbox.EventWindow{}) {
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

package inboxcheck_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/inboxcheck"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// Two handlers of order events, checked as a broker would deliver to them.
// In a test, call inboxcheck.Run(t, db, subject): it fails the test with
// each finding. Check returns them, as here.
func Example() {
	ctx := context.Background()
	uri, err := inboxtest.SharedURI() // or any MongoDB: "mongodb://..."
	if err != nil {
		panic(err)
	}
	// The kit's monitor lets it interrupt a handler between its commands.
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetMonitor(inboxcheck.Monitor(nil)))
	if err != nil {
		panic(err)
	}
	defer client.Disconnect(ctx)
	db := client.Database("inboxcheck_example")
	defer db.Drop(ctx)
	shipments := db.Collection("shipments")

	var seq atomic.Int64 // the order effects were applied in
	apply := func(ctx context.Context, m inboxcheck.Message, id any) error {
		_, err := shipments.InsertOne(ctx, bson.D{{Key: "_id", Value: id}, {Key: "order_id", Value: m.AggregateID},
			{Key: "message_id", Value: m.ID}, {Key: "seq", Value: seq.Add(1)}})
		return err
	}
	applied := func(ctx context.Context, orderID string) ([]string, error) {
		cur, err := shipments.Find(ctx, bson.D{{Key: "order_id", Value: orderID}}, options.Find().SetSort(bson.D{{Key: "seq", Value: 1}}))
		if err != nil {
			return nil, err
		}
		var docs []struct {
			MessageID string `bson:"message_id"`
		}
		err = cur.All(ctx, &docs)
		ids := make([]string, len(docs))
		for i, d := range docs {
			ids[i] = d.MessageID
		}
		return ids, err
	}
	version := func(orderID string, v int64) bson.D {
		return bson.D{{Key: "_id", Value: fmt.Sprintf("%s/%d", orderID, v)}}
	}

	// Right: reads before it writes, waits for the previous version, and
	// keys its effect on the order's version.
	good := inboxcheck.Subject{Applied: applied, Handler: func(m inboxcheck.Message) inbox.Handler {
		return func(ctx context.Context) error {
			if err := shipments.FindOne(ctx, version(m.AggregateID, m.Version)).Err(); !errors.Is(err, mongo.ErrNoDocuments) {
				return err // nil: applied already
			}
			if m.Version > 1 {
				if err := shipments.FindOne(ctx, version(m.AggregateID, m.Version-1)).Err(); err != nil {
					return err // not yet: the message comes again later
				}
			}
			err := apply(ctx, m, fmt.Sprintf("%s/%d", m.AggregateID, m.Version))
			if mongo.IsDuplicateKeyError(err) && mongo.SessionFromContext(ctx) == nil {
				return nil // a concurrent copy applied it
			}
			return err
		}
	}}
	report, err := inboxcheck.Check(ctx, db, good)
	if err != nil {
		panic(err)
	}
	fmt.Println("keyed handler:", len(report.Findings), "findings")

	// Wrong: a new line per run, whatever came before.
	bad := inboxcheck.Subject{Applied: applied, Handler: func(m inboxcheck.Message) inbox.Handler {
		return func(ctx context.Context) error { return apply(ctx, m, bson.NewObjectID()) }
	}}
	report, err = inboxcheck.Check(ctx, db, bad)
	if err != nil {
		panic(err)
	}
	seen := map[string]bool{}
	for _, f := range report.Findings {
		if line := f.Scenario + ": " + f.Problem; !seen[line] {
			seen[line] = true
			fmt.Println("plain insert:", line)
		}
	}
	// Output:
	// keyed handler: 0 findings
	// plain insert: crash_window: applied twice
	// plain insert: crash_inside: applied twice
	// plain insert: concurrent: applied twice
	// plain insert: out_of_order: out of order
	// plain insert: shuffled: out of order
	// plain insert: expired_record: applied twice
}

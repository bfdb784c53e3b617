package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// A consumer receives the same message three times; its effect is applied
// once. The handler is right in both modes: it reads before it writes,
// returns every error, and its effect is keyed (order-1/1: the order's first
// event), so a second run is a no-op or a duplicate key.
func Example() {
	ctx := context.Background()
	uri := exampleURI() // your server: "mongodb://127.0.0.1:27017"
	client, err := mongo.Connect(options.Client().ApplyURI(uri))
	if err != nil {
		panic(err)
	}
	defer client.Disconnect(ctx)
	db := client.Database(exampleDatabase()) // your database: "shipping"
	defer db.Drop(ctx)

	in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
	if err != nil {
		panic(err)
	}
	if err := in.EnsureIndexes(ctx); err != nil {
		panic(err)
	}

	shipments := db.Collection("shipments")
	for range 3 { // the broker delivers message 42 three times
		res, err := in.Process(ctx, "42", func(ctx context.Context) error {
			// Use the ctx given here: in transaction mode it carries the
			// session. Read before writing, and return every write error: in
			// transaction mode a write error has aborted the transaction.
			err := shipments.FindOne(ctx, bson.D{{Key: "_id", Value: "order-1/1"}}).Err()
			if err == nil {
				return nil // already applied (say, its inbox record expired)
			}
			if !errors.Is(err, mongo.ErrNoDocuments) {
				return err
			}
			// The unique _id keeps the effect single: a concurrent duplicate
			// fails here, and its redelivery finds the effect.
			_, err = shipments.InsertOne(ctx, bson.D{{Key: "_id", Value: "order-1/1"}, {Key: "message_id", Value: "42"}})
			return err
		})
		if err != nil {
			panic(err) // do not ack: the message will be redelivered
		}
		fmt.Println(res) // ack the delivery here
	}
	n, _ := shipments.CountDocuments(ctx, bson.D{})
	fmt.Println("effects:", n)
	// Output:
	// processed
	// duplicate
	// duplicate
	// effects: 1
}

// exampleURI is the tests' MongoDB (TEST_MONGO_URI, or this repository's
// test server). Examples cannot skip: they need it.
func exampleURI() string {
	uri, err := inboxtest.SharedURI()
	if err != nil {
		panic(fmt.Sprintf("examples need MongoDB: %v", err))
	}
	return uri
}

// exampleDatabase is a database name of the example's own.
func exampleDatabase() string { return "example_" + inboxtest.RandomSuffix() }

// A loss audit reads the ids a consumer recorded as done, in byte order of
// the ids, to compare them with what the producer committed.
func ExampleInbox_Recorded() {
	ctx := context.Background()
	client, err := mongo.Connect(options.Client().ApplyURI(exampleURI()))
	if err != nil {
		panic(err)
	}
	defer client.Disconnect(ctx)
	db := client.Database(exampleDatabase())
	defer db.Drop(ctx)

	in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
	if err != nil {
		panic(err)
	}
	for _, id := range []string{"9", "10", "11"} {
		if _, err := in.Process(ctx, id, func(context.Context) error { return nil }); err != nil {
			panic(err)
		}
	}
	for m, err := range in.Recorded(ctx, time.Time{}, 0) {
		if err != nil {
			panic(err)
		}
		fmt.Println(m.MessageID)
	}
	// Output:
	// 10
	// 11
	// 9
}

// An order's versions arrive 2, 1, 3, and 2 again. The gate holds version 2
// back until version 1 is applied (a real consumer defers it through a delay
// queue, bounded, then parks or dead-letters it), so the order-blind handler
// runs 1, 2, 3, once each.
func ExampleGate() {
	ctx := context.Background()
	client, err := mongo.Connect(options.Client().ApplyURI(exampleURI()))
	if err != nil {
		panic(err)
	}
	defer client.Disconnect(ctx)
	db := client.Database(exampleDatabase())
	defer db.Drop(ctx)

	in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
	if err != nil {
		panic(err)
	}
	gate, err := inbox.NewGate(in, inbox.GateConfig{})
	if err != nil {
		panic(err)
	}
	queue := []int64{2, 1, 3, 2}
	for len(queue) > 0 {
		v := queue[0]
		queue = queue[1:]
		id := fmt.Sprintf("order-1/%d", v) // the message id
		res, err := gate.Process(ctx, id, inbox.Position{Aggregate: "order-1", Version: v}, func(ctx context.Context) error {
			fmt.Println("apply version", v) // idempotent on its own key, as ModeStandalone requires
			return nil
		})
		var gap *inbox.GapError
		switch {
		case errors.As(err, &gap):
			fmt.Printf("version %d waits for %d\n", v, gap.Position.Version-1)
			queue = append(queue, v) // defer it: redelivered after the others
		case err != nil:
			panic(err) // do not ack
		default:
			fmt.Println(v, res) // ack
		}
	}
	// Output:
	// version 2 waits for 1
	// apply version 1
	// 1 processed
	// version 3 waits for 2
	// apply version 2
	// 2 processed
	// 2 duplicate
	// apply version 3
	// 3 processed
}

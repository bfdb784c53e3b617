package inbox_test

import (
	"context"
	"fmt"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal"
	"github.com/outbox-inbox/reference/pkg/inbox"
)

// A consumer receives the same message three times; its effect is applied
// once. The example runs on an embedded FerretDB (no transactions), so the
// inbox uses its standalone protocol and the effect is keyed by the message.
func Example() {
	ctx := context.Background()
	srv, err := mongolocal.Start(ctx, mongolocal.Config{})
	if err != nil {
		panic(err)
	}
	defer srv.Close()
	client, err := mongo.Connect(options.Client().ApplyURI(srv.URI()))
	if err != nil {
		panic(err)
	}
	defer client.Disconnect(ctx)
	db := client.Database("example")

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
			// Use the ctx given here: in transaction mode it carries the session.
			_, err := shipments.InsertOne(ctx, bson.D{{Key: "_id", Value: "order-1/1"}, {Key: "message_id", Value: "42"}})
			if mongo.IsDuplicateKeyError(err) {
				return nil // already applied: the effect is idempotent on its own key
			}
			return err
		})
		if err != nil {
			panic(err) // do not ack: the message will be redelivered
		}
		fmt.Println(res) // ack the delivery here
	}
	mode, _ := in.Mode(ctx)
	n, _ := shipments.CountDocuments(ctx, bson.D{})
	fmt.Println("mode:", mode, "effects:", n)
	// Output:
	// processed
	// duplicate
	// duplicate
	// mode: standalone effects: 1
}

package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/FerretDB/FerretDB/ferretdb"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
)

// A consumer receives the same message three times; its effect is applied
// once. The example runs on an embedded FerretDB (no transactions), so the
// inbox uses its standalone protocol; the same handler is right in
// transaction mode: it reads before it writes, returns every error, and its
// effect is keyed (order-1/1: the order's first event), so a second run is a
// no-op or a duplicate key.
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	uri, stop, err := startFerretDB(ctx) // or any MongoDB: uri := "mongodb://..."
	if err != nil {
		panic(err)
	}
	defer stop()
	client, err := mongo.Connect(options.Client().ApplyURI(uri))
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
	mode, _ := in.Mode(ctx)
	n, _ := shipments.CountDocuments(ctx, bson.D{})
	fmt.Println("mode:", mode, "effects:", n)
	// Output:
	// processed
	// duplicate
	// duplicate
	// mode: standalone effects: 1
}

// startFerretDB runs a FerretDB with its SQLite files in a temporary
// directory inside this process, until ctx ends; stop waits for it and
// removes the files.
func startFerretDB(ctx context.Context) (uri string, stop func(), err error) {
	dir, err := os.MkdirTemp("", "inbox-example-")
	if err != nil {
		return "", nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0") // a free port
	if err != nil {
		return "", nil, err
	}
	addr := l.Addr().String()
	_ = l.Close()
	f, err := ferretdb.New(&ferretdb.Config{
		Listener:  ferretdb.ListenerConfig{TCP: addr},
		Logger:    slog.New(slog.DiscardHandler),
		Handler:   "sqlite",
		SQLiteURL: "file:" + dir + "/",
	})
	if err != nil {
		return "", nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = f.Run(ctx)
	}()
	return f.MongoDBURI(), func() {
		cancel()
		<-done
		_ = os.RemoveAll(dir)
	}, nil
}

// A loss audit reads the ids a consumer recorded as done, in byte order of
// the ids, to compare them with what the producer committed.
func ExampleInbox_Recorded() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	uri, stop, err := startFerretDB(ctx)
	if err != nil {
		panic(err)
	}
	defer stop()
	client, err := mongo.Connect(options.Client().ApplyURI(uri))
	if err != nil {
		panic(err)
	}
	defer client.Disconnect(ctx)

	in, err := inbox.New(client.Database("example"), inbox.Config{Consumer: "shipping"})
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

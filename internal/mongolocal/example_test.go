package mongolocal_test

import (
	"context"
	"fmt"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal"
)

// Start an embedded FerretDB on a free loopback port, talk to it with the
// official driver, stop it.
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
	coll := client.Database("demo").Collection("things")
	_, _ = coll.InsertOne(ctx, bson.D{{Key: "_id", Value: "a"}})
	_, err = coll.InsertOne(ctx, bson.D{{Key: "_id", Value: "a"}})
	fmt.Println("duplicate key:", mongo.IsDuplicateKeyError(err))
	// Output: duplicate key: true
}

package mongodb_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// abortingCollection behaves as a collection inside a MongoDB transaction
// does: once an operation failed with a write error (a duplicate key among
// them), the server has aborted the transaction, and every later operation
// fails with NoSuchTransaction. FerretDB has no transactions; this keeps
// that rule testable here.
type abortingCollection struct {
	mongodb.Collection
	mu      sync.Mutex
	aborted bool
}

var errNoSuchTransaction = mongo.CommandError{
	Code: 251, Name: "NoSuchTransaction", Message: "Transaction with { txnNumber: 1 } has been aborted.",
	Labels: []string{"TransientTransactionError"},
}

func (c *abortingCollection) isAborted() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.aborted
}

func (c *abortingCollection) FindOne(ctx context.Context, filter any, opts ...options.Lister[options.FindOneOptions]) *mongo.SingleResult {
	if c.isAborted() {
		return mongo.NewSingleResultFromDocument(bson.D{}, errNoSuchTransaction, nil)
	}
	return c.Collection.FindOne(ctx, filter, opts...)
}

func (c *abortingCollection) InsertOne(ctx context.Context, doc any, opts ...options.Lister[options.InsertOneOptions]) (*mongo.InsertOneResult, error) {
	if c.isAborted() {
		return nil, errNoSuchTransaction
	}
	res, err := c.Collection.InsertOne(ctx, doc, opts...)
	if err != nil {
		c.mu.Lock()
		c.aborted = true
		c.mu.Unlock()
	}
	return res, err
}

// inTransaction returns a store whose every Apply runs as in a transaction
// of its own, on db.
func inTransaction(db *mongo.Database) func() *mongodb.Store {
	return func() *mongodb.Store {
		return mongodb.NewWrapped(db, func(c mongodb.Collection) mongodb.Collection { return &abortingCollection{Collection: c} })
	}
}

func TestApplyInATransactionNeverRecoversFromAWriteError(t *testing.T) {
	t.Parallel()
	db := mongotest.Database(t)
	plain, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	tx := inTransaction(db)
	ctx := t.Context()

	// An effect without an inbox record (its record expired, or it was
	// applied in standalone mode): a redelivery must be recognised, not fail.
	if _, err := plain.Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil {
		t.Fatal(err)
	}
	if o, err := tx().Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil || o != shipment.OutcomeAlreadyApplied {
		t.Fatalf("effect already there: %v, %v; want AlreadyApplied", o, err)
	}
	// Another message at an applied version: a version conflict, not a
	// database failure.
	if _, err := tx().Apply(ctx, "9", ev(shipment.TypeCreated, 1)); !errors.Is(err, shipment.ErrVersionConflict) {
		t.Fatalf("another message at version 1: %v, want ErrVersionConflict", err)
	}
	if o, err := tx().Apply(ctx, "2", ev(shipment.TypeCancelled, 2)); err != nil || o != shipment.OutcomeApplied {
		t.Fatalf("next version: %v, %v; want Applied", o, err)
	}
	if o, err := tx().Apply(ctx, "2", ev(shipment.TypeCancelled, 2)); err != nil || o != shipment.OutcomeAlreadyApplied {
		t.Fatalf("next version again: %v, %v; want AlreadyApplied", o, err)
	}
}

package mongodb_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/event"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Without transactions the service acks a message once its effect is
// written and its inbox record buffered; the record is written a few
// milliseconds later. On a standalone mongod an unjournaled effect can be
// lost by a crash after that ack, so the effect itself is written with j:
// true (inside a transaction the driver leaves the write concern to the
// commit).
func TestEffectsAreWrittenWithAJournaledWriteConcern(t *testing.T) {
	t.Parallel()
	uri, dbName := mongotest.ForTest(t)
	var mu sync.Mutex
	var inserts []bson.Raw
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(10 * time.Second).
		SetMonitor(&event.CommandMonitor{Started: func(_ context.Context, e *event.CommandStartedEvent) {
			if e.CommandName == "insert" {
				mu.Lock()
				inserts = append(inserts, e.Command)
				mu.Unlock()
			}
		}}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	s, err := mongodb.New(client.Database(dbName), "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Apply(t.Context(), ev("1", shipment.TypeCreated, 1)); err != nil {
		t.Fatal(err)
	}
	if err := s.Skip(t.Context(), "o-1", 2, "2", "order.paid"); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(inserts) != 2 {
		t.Fatalf("%d inserts, want 2", len(inserts))
	}
	for _, cmd := range inserts {
		j, ok := cmd.Lookup("writeConcern", "j").BooleanOK()
		if !ok || !j {
			t.Fatalf("insert %s: want writeConcern {j: true}", cmd)
		}
	}
}

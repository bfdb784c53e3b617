package deadletter

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
)

// A parked message is acked once Park returns: the parked copy is then its
// only copy, so it is written with j: true (a standalone mongod acknowledges
// a plain write before its journal commit, and a crash then would lose it).
// The dead letter and the hold are written the same way.
func TestParkedMessagesAndDeadLettersAreWrittenJournaled(t *testing.T) {
	t.Parallel()
	uri, dbName := mongotest.ForTest(t)
	var mu sync.Mutex
	writes := map[string]bson.Raw{}
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(10 * time.Second).
		SetMonitor(&event.CommandMonitor{Started: func(_ context.Context, e *event.CommandStartedEvent) {
			if e.CommandName == "insert" || e.CommandName == "update" {
				coll, _ := e.Command.Lookup(e.CommandName).StringValueOK()
				mu.Lock()
				writes[e.CommandName+" "+coll] = e.Command
				mu.Unlock()
			}
		}}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	s, err := NewStore(client.Database(dbName))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	if err := s.Record(t.Context(), Letter{OrderID: "o-1", Version: 2, Reason: "handler_failed", Holds: true,
		DeadLetteredAt: now, Message: msg("m2")}); err != nil {
		t.Fatal(err)
	}
	if err := s.Park(t.Context(), Parked{OrderID: "o-1", Version: 3, ParkedAt: now, Message: msg("m3")}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, w := range []string{"insert " + ParkedCollection, "update " + LettersCollection, "update " + HoldsCollection} {
		cmd, ok := writes[w]
		if !ok {
			t.Fatalf("no %s among %d writes", w, len(writes))
		}
		if j, ok := cmd.Lookup("writeConcern", "j").BooleanOK(); !ok || !j {
			t.Fatalf("%s: %s; want writeConcern {j: true}", w, cmd)
		}
	}
}

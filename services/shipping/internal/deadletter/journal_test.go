package deadletter

import (
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
)

// A parked message is acked once Park returns: the parked copy is then its
// only copy, so it is written with j: true (a standalone mongod acknowledges
// a plain write before its journal commit, and a crash then would lose it).
// The dead letter and the hold are written the same way.
func TestParkedMessagesAndDeadLettersAreWrittenJournaled(t *testing.T) {
	t.Parallel()
	db, cmds := mongotest.Watched(t)
	s, err := NewStore(db)
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
	writes := map[string]bson.Raw{}
	for _, e := range cmds.Named("insert", "update") {
		coll, _ := e.Command.Lookup(e.CommandName).StringValueOK()
		writes[e.CommandName+" "+coll] = e.Command
	}
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

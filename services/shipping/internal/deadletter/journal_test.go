package deadletter

import (
	"errors"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// A parked message is acked once Park returns: the parked copy is then its
// only copy, so it is written with j: true (a standalone mongod acknowledges
// a plain write before its journal commit, and a crash then would lose it).
// The dead letter and the hold are written the same way. All three are
// written with w: "majority", whatever the server's default write concern
// or MONGO_URI's: an acknowledged dead letter or parked message must survive
// a failover, as the inbox's records do.
func TestParkedMessagesAndDeadLettersAreWrittenJournaledToAMajority(t *testing.T) {
	t.Parallel()
	db, cmds := mongotest.Watched(t)
	s, err := NewStore(db)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	if err := s.Record(t.Context(), shipment.Letter{OrderID: "o-1", Version: 2, Reason: "handler_failed", Holds: true,
		DeadLetteredAt: now, Message: msg("m2")}); err != nil {
		t.Fatal(err)
	}
	if err := s.Park(t.Context(), shipment.Parked{OrderID: "o-1", Version: 3, ParkedAt: now, Message: msg("m3")}); err != nil {
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
		j, jok := cmd.Lookup("writeConcern", "j").BooleanOK()
		wc, wok := cmd.Lookup("writeConcern", "w").StringValueOK()
		if !jok || !j || !wok || wc != "majority" {
			t.Fatalf("%s: %s; want writeConcern {w: \"majority\", j: true}", w, cmd)
		}
	}
}

// A dead letter whose body MongoDB cannot hold (over its 16 MiB document
// limit) is recorded without its body, saying so: otherwise its delivery is
// kept and redelivered for ever. The broker's dead-letter queue has the whole
// message; a replay from the record is refused, a discard works.
func TestADeadLetterTooLargeForMongoDBIsRecordedWithoutItsBody(t *testing.T) {
	t.Parallel()
	s, err := NewStore(mongotest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	huge := msg("m-huge")
	huge.Body = make([]byte, 17<<20)
	if err := s.Record(ctx, shipment.Letter{OrderID: "o-big", Version: 1, Reason: "oversize", Holds: true,
		DeadLetteredAt: time.Now().UTC(), Message: huge}); err != nil {
		t.Fatalf("Record of a 17 MiB dead letter: %v", err)
	}
	var stored letterDoc
	if err := s.letters.FindOne(ctx, byID("o-big/1")).Decode(&stored); err != nil {
		t.Fatal(err)
	}
	if len(stored.Message.Body) != 0 || stored.Message.BodyOmitted != 17<<20 {
		t.Fatalf("stored body %d bytes, omitted %d; want none kept and 17 MiB omitted", len(stored.Message.Body), stored.Message.BodyOmitted)
	}
	m, err := NewManager(Config{Store: s, Publisher: &fakePublisher{}, Skipper: &fakeSkipper{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Replay(ctx, "o-big", 1); !errors.Is(err, shipment.ErrBodyNotKept) {
		t.Fatalf("Replay: %v; want ErrBodyNotKept", err)
	}
	if h, err := s.Held(ctx, "o-big"); err != nil || h == nil || h.State != shipment.StateHeld {
		t.Fatalf("hold after the refused replay: %+v, %v; want it still held, not releasing", h, err)
	}
	if _, err := m.Discard(ctx, "o-big", 1); err != nil {
		t.Fatalf("Discard: %v", err)
	}
	if h, err := s.Held(ctx, "o-big"); err != nil || h != nil {
		t.Fatalf("hold after the discard: %+v, %v; want none", h, err)
	}
}

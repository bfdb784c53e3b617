package mongodb_test

import (
	"testing"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Without transactions the service acks a message once its effect is
// written and its inbox record buffered; the record is written a few
// milliseconds later. On a standalone mongod an unjournaled effect can be
// lost by a crash after that ack, so the effect itself is written with j:
// true (inside a transaction the driver leaves the write concern to the
// commit), and so is its effect-log entry.
func TestEffectsAreWrittenWithAJournaledWriteConcern(t *testing.T) {
	t.Parallel()
	db, cmds := mongotest.Watched(t)
	s, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Apply(t.Context(), "1", ev(shipment.TypeCreated, 1)); err != nil {
		t.Fatal(err)
	}
	if err := s.Skip(t.Context(), "o-1", 2, "2", "order.paid"); err != nil {
		t.Fatal(err)
	}
	inserts := cmds.Named("insert")
	if len(inserts) != 3 {
		t.Fatalf("%d inserts, want 3 (the effect, its effect-log entry, the skip)", len(inserts))
	}
	for _, e := range inserts {
		j, ok := e.Command.Lookup("writeConcern", "j").BooleanOK()
		if !ok || !j {
			t.Fatalf("insert %s: want writeConcern {j: true}", e.Command)
		}
	}
}

package deadletter

import (
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// An order can hold two dead letters: version 2 (its handler kept failing)
// and version 4 (a malformed message that came while 2 held the order). The
// hold must stay at the earliest dead version, and settling one of them must
// leave the order held behind the other: otherwise the versions parked after
// it are released into gaps and deferred until they are dead-lettered too.
func TestAnOrderWithTwoDeadLettersStaysHeldUntilBothAreSettled(t *testing.T) {
	t.Parallel()
	s, err := NewStore(mongotest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	now := time.Now().UTC()
	record := func(v int64, reason string) {
		t.Helper()
		if err := s.Record(ctx, shipment.Letter{OrderID: "o-1", Version: v, Reason: reason, Holds: true,
			DeadLetteredAt: now.Add(time.Duration(v) * time.Millisecond), Message: msg(msgID(v))}); err != nil {
			t.Fatal(err)
		}
	}
	park := func(v int64) {
		t.Helper()
		if err := s.Park(ctx, shipment.Parked{OrderID: "o-1", Version: v, ParkedAt: now, Message: msg(msgID(v))}); err != nil {
			t.Fatal(err)
		}
	}
	held := func() *shipment.Hold {
		t.Helper()
		h, err := s.Held(ctx, "o-1")
		if err != nil {
			t.Fatal(err)
		}
		return h
	}

	record(2, "handler_failed")
	park(3)
	record(4, "malformed_payload")
	if h := held(); h == nil || h.Version != 2 || h.State != shipment.StateHeld {
		t.Fatalf("hold after a second dead letter at version 4: %+v; want it still at version 2", h)
	}
	park(5)

	pub, skip := &fakePublisher{}, &fakeSkipper{}
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	if _, err := m.Replay(ctx, "o-1", 2); err != nil {
		t.Fatalf("Replay 2: %v", err)
	}
	if h := held(); h == nil || h.Version != 4 || h.State != shipment.StateHeld {
		t.Fatalf("hold after replaying version 2 while version 4 is still dead: %+v; want the order held at version 4", h)
	}
	// Version 3 can apply now; 5 comes back to a gap and parks again.
	if want := []string{"m2", "m3", "m5"}; !slices.Equal(pub.published, want) {
		t.Fatalf("published %v, want %v", pub.published, want)
	}

	park(5)
	if _, err := m.Discard(ctx, "o-1", 4); err != nil {
		t.Fatalf("Discard 4: %v", err)
	}
	if want := []string{"m2", "m3", "m5", "m5"}; !slices.Equal(pub.published, want) {
		t.Fatalf("published %v, want %v", pub.published, want)
	}
	wantReleased(t, s)
}

func msgID(v int64) string { return "m" + string(rune('0'+v)) }

// Headers kept before they were stored as typed entries (an embedded
// document) are still read, converted back to AMQP values where BSON kept
// their types.
func TestHeadersStoredAsADocumentAreStillRead(t *testing.T) {
	t.Parallel()
	s, err := NewStore(mongotest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	at := time.Unix(1764450000, 0)
	if _, err := s.parked.InsertOne(t.Context(), bson.D{
		{Key: "_id", Value: "o-1/2"}, {Key: "order_id", Value: "o-1"}, {Key: "version", Value: int64(2)}, {Key: "parked_at", Value: at},
		{Key: "message", Value: bson.D{{Key: "message_id", Value: "m2"}, {Key: "routing_key", Value: "order.cancelled"}, {Key: "body", Value: []byte("{}")},
			{Key: "headers", Value: bson.D{
				{Key: "aggregate_id", Value: "o-1"}, {Key: "aggregate_version", Value: int64(2)}, {Key: "n", Value: int32(3)},
				{Key: "at", Value: bson.NewDateTimeFromTime(at)}, {Key: "raw", Value: bson.Binary{Data: []byte{1}}},
				{Key: "t", Value: bson.D{{Key: "k", Value: "v"}}}, {Key: "a", Value: bson.A{"x", int64(1)}},
			}}}},
	}); err != nil {
		t.Fatal(err)
	}
	ps, err := s.parkedOf(t.Context(), "o-1")
	if err != nil || len(ps) != 1 {
		t.Fatalf("parkedOf: %v, %v", ps, err)
	}
	h := ps[0].Message.Headers
	if h["aggregate_id"] != "o-1" || h["aggregate_version"] != int64(2) || h["n"] != int32(3) || !h["at"].(time.Time).Equal(at) ||
		!slices.Equal(h["raw"].([]byte), []byte{1}) || h["t"].(amqp.Table)["k"] != "v" || len(h["a"].([]any)) != 2 {
		t.Fatalf("headers %#v", h)
	}
}

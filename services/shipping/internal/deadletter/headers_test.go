package deadletter_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/deadletter"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

type noSkip struct{}

func (noSkip) Skip(context.Context, string, int64, string, string) error { return nil }

// awkwardHeaders holds what a delivery's headers may be, as amqp091-go
// decodes them: keys MongoDB cannot take as field names ('.' inside, '$'
// first), and a value of every AMQP field type.
func awkwardHeaders() map[string]any {
	return map[string]any{
		"tenant.id": "acme", "$set": "not an operator", "a.b.$c": int64(1), "aggregate_id": "o-1",
		"at": time.Unix(1764450000, 0), "raw": []byte{0, 1, 2, 255},
		"nested": amqp.Table{"x.y": int32(7), "$deep": amqp.Table{"z": true}},
		"list":   []any{"a", int64(2), amqp.Table{"k.k": "v"}, []any{int16(3)}, nil},
		"i8":     int8(-8), "u8": uint8(8), "i16": int16(-16), "u16": uint16(16),
		"i32": int32(-32), "u32": uint32(4000000000), "i64": int64(-64),
		"f32": float32(1.5), "f64": 2.25, "dec": amqp.Decimal{Scale: 2, Value: 1234},
		"none": nil, "yes": true,
	}
}

// sameHeaders fails t unless got holds want's keys with the same values of
// the same types (timestamps compared as instants).
func sameHeaders(t *testing.T, what string, got, want map[string]any) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d headers %v, want %d", what, len(got), got, len(want))
	}
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("%s: header %q missing", what, k)
			continue
		}
		if wt, isTime := w.(time.Time); isTime {
			if gt, ok := g.(time.Time); !ok || !gt.Equal(wt) {
				t.Errorf("%s: header %q = %T %v, want time.Time %v", what, k, g, g, wt)
			}
			continue
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s: header %q = %T %#v, want %T %#v", what, k, g, g, w, w)
		}
	}
}

// Any AMQP header survives a dead letter, a parked message and their
// replay: keys with '.' or a leading '$', and every field type, with its
// type.
func TestHeadersOfAnyKeyAndTypeSurviveParkingAndReplay(t *testing.T) {
	t.Parallel()
	url, ch := amqptest.Queue(t, "q")
	store, err := deadletter.NewStore(mongotest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	now := time.Now().UTC()
	kept := func(id string) shipment.KeptMessage {
		return shipment.KeptMessage{MessageID: id, RoutingKey: "order.cancelled", Headers: awkwardHeaders(), Body: []byte("{}")}
	}
	if err := store.Record(ctx, shipment.Letter{OrderID: "o-1", Version: 1, Reason: "handler_failed", Holds: true,
		DeadLetteredAt: now, Message: kept("m1")}); err != nil {
		t.Fatalf("Record: %v", err)
	}
	if err := store.Park(ctx, shipment.Parked{OrderID: "o-1", Version: 2, ParkedAt: now, Message: kept("m2")}); err != nil {
		t.Fatalf("Park: %v", err)
	}
	pub := &rabbitmq.ReplayPublisher{URL: url, Queue: "q"}
	t.Cleanup(func() { _ = pub.Close() })
	mgr, err := deadletter.NewManager(deadletter.Config{Store: store, Publisher: pub, Skipper: noSkip{}})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := mgr.Replay(ctx, "o-1", 1); err != nil || n != 1 {
		t.Fatalf("Replay: %d, %v; want 1 released", n, err)
	}
	for _, id := range []string{"m1", "m2"} {
		d := amqptest.GetOne(t, ch, "q")
		if d.MessageId != id {
			t.Fatalf("replayed %s, want %s", d.MessageId, id)
		}
		sameHeaders(t, fmt.Sprintf("replayed %s", id), d.Headers, awkwardHeaders())
	}
}

package app_test

import (
	"encoding/json"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// paid is an event type shipping does not handle, at version 2 of its order.
func paid(msgID, orderID string) event {
	body, _ := json.Marshal(map[string]any{"order_id": orderID, "paid_at": "2026-11-29T22:00:30Z"})
	return event{MessageID: msgID, Type: "order.paid", OrderID: orderID, Version: int64(2), Body: body}
}

func TestEventTypeUnknownToShippingStillAdvancesItsOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// Few deferrals: on a consumer that does not record the ignored version,
	// the cancel waits for version 2 and is dead-lettered quickly.
	a := e.start(app.Config{MaxDeferrals: 10})

	cancel := cancelled("1203", "order-12")
	cancel.Version = int64(3)
	e.pub.publish(created("1201", "order-12"))
	e.pub.publish(paid("1202", "order-12"))
	e.pub.publish(cancel)

	e.waitDrained(a)
	if dl := e.deadLetters(a.Topology().DeadLetterQueue); len(dl) != 0 {
		t.Fatalf("%d dead letters (first: %v), want none", len(dl), dl[0].Headers[`x-dead-letter-reason`])
	}
	s := e.waitShipment("order-12", 3)
	wantEvents(t, s, "1201", "1202", "1203")
	if s.Status != shipment.StatusCancelled || s.Events[1].EventType != "order.paid" {
		t.Fatalf("shipment %+v: want cancelled, with order.paid recorded as version 2", s)
	}
	if n := value(a.Metrics().UnknownType); n != 1 {
		t.Errorf("unknown-type count %v, want 1", n)
	}
}

func TestTypelessMessageKeepsItsTypeThroughTheDelayQueue(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{})

	// A cancel whose type is only in its routing key, ahead of its create:
	// it goes through the delay queue and comes back with the queue's name
	// as its routing key.
	cancel := cancelled("1302", "order-13")
	cancel.Untyped = true
	cancel.Headers = amqp.Table{"event_type": nil}
	e.pub.publish(cancel)
	waitFor(t, 30*time.Second, "the early cancel to be deferred", func() bool { return deferredGap(a) > 0 })
	e.pub.publish(created("1301", "order-13"))

	waitFor(t, 60*time.Second, "the cancel applied", func() bool {
		s, ok := e.shipment("order-13")
		return ok && len(s.Events) == 2
	})
	s, _ := e.shipment("order-13")
	wantEvents(t, s, "1301", "1302")
	if n := value(a.Metrics().UnknownType); n != 0 {
		t.Errorf("unknown-type count %v, want 0: the cancel lost its type in the delay queue", n)
	}
}

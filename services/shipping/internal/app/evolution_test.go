package app_test

import (
	"encoding/json"
	"fmt"
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
	testEventTypeUnknownToShippingStillAdvancesItsOrder(t, newEnv(t))
}

func testEventTypeUnknownToShippingStillAdvancesItsOrder(t *testing.T, e *env) {
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
	if vs := e.order.waitVersions(t, "order-12", 3); fmt.Sprint(vs) != "[1 2 3]" {
		t.Errorf("application order %v, want [1 2 3]", vs)
	}
}

func TestTypelessMessageKeepsItsTypeThroughTheDelayQueue(t *testing.T) {
	t.Parallel()
	testTypelessMessageKeepsItsTypeThroughTheDelayQueue(t, newEnv(t))
}

func testTypelessMessageKeepsItsTypeThroughTheDelayQueue(t *testing.T, e *env) {
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

func TestEffectWithoutInboxRecordIsADuplicate(t *testing.T) {
	t.Parallel()
	testEffectWithoutInboxRecordIsADuplicate(t, newEnv(t))
}

// An effect whose inbox record is gone (expired by retention before a late
// redelivery, or written in standalone mode before a move to a replica set)
// is recognised by its version: acked, one effect, no dead letter.
func testEffectWithoutInboxRecordIsADuplicate(t *testing.T, e *env) {
	ev := shipment.Event{Type: shipment.TypeCreated, OrderID: "order-14", Version: 1,
		Created: &shipment.Created{OrderID: "order-14", CustomerID: "c-42", Currency: "EUR", Total: 2500}}
	if _, err := e.store.Apply(t.Context(), "1401", ev); err != nil {
		t.Fatal(err)
	}
	a := e.start(app.Config{MaxAttempts: 2})
	e.pub.publish(created("1401", "order-14"))
	waitFor(t, 30*time.Second, "the redelivery counted as a duplicate", func() bool { return dupVersion(a) == 1 })
	e.waitDrained(a)
	if dl := e.deadLetters(a.Topology().DeadLetterQueue); len(dl) != 0 {
		t.Fatalf("dead-lettered (%v): an effect without its inbox record is a duplicate", dl[0].Headers["x-dead-letter-reason"])
	}
	s, _ := e.shipment("order-14")
	wantEvents(t, s, "1401")
	waitFor(t, 10*time.Second, "the inbox record", func() bool {
		done, err := e.inbox.IsDone(t.Context(), "1401")
		return err == nil && done
	})
}

func TestVersionConflictIsDeadLetteredAsSuch(t *testing.T) {
	t.Parallel()
	testVersionConflictIsDeadLetteredAsSuch(t, newEnv(t))
}

func testVersionConflictIsDeadLetteredAsSuch(t *testing.T, e *env) {
	a := e.start(app.Config{MaxAttempts: 2})
	e.pub.publish(created("1501", "order-15"))
	e.waitShipment("order-15", 1)
	e.pub.publish(created("1599", "order-15")) // another message at version 1
	var dead []amqp.Delivery
	waitFor(t, 30*time.Second, "a dead letter", func() bool {
		dead = append(dead, e.deadLetters(a.Topology().DeadLetterQueue)...)
		return len(dead) > 0
	})
	if len(dead) != 1 || dead[0].MessageId != "1599" || dead[0].Headers["x-dead-letter-reason"] != string(shipment.ReasonVersionConflict) {
		t.Fatalf("dead letter %q reason %v (%v), want 1599 with reason version_conflict",
			dead[0].MessageId, dead[0].Headers["x-dead-letter-reason"], dead[0].Headers["x-error"])
	}
	s, _ := e.shipment("order-15")
	wantEvents(t, s, "1501")
}

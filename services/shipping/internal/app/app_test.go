package app_test

import (
	"fmt"
	"testing"

	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

func TestRedeliveredMessagesProduceOneEffectWithTwoConsumers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{})
	e.start(app.Config{})

	// The relay may publish the same outbox row several times.
	const copiesCreate, copiesCancel = 4, 3
	for range copiesCreate {
		e.pub.publish(created("101", "order-1"))
	}
	for range copiesCancel {
		e.pub.publish(cancelled("102", "order-1"))
	}
	s := e.waitShipment("order-1", 2)
	e.waitDrained(a)
	wantEvents(t, s, "101", "102")
	if s.Status != shipment.StatusCancelled {
		t.Errorf("status %q, want %q", s.Status, shipment.StatusCancelled)
	}
	waitFor(t, 10e9, "every delivery counted", func() bool {
		return e.sum(processed)+e.sum(dupInbox)+e.sum(dupVersion) == copiesCreate+copiesCancel
	})
	if p := e.sum(processed); p != 2 {
		t.Errorf("processed %v, want 2", p)
	}
	if d := e.sum(dupInbox) + e.sum(dupVersion); d != copiesCreate+copiesCancel-2 {
		t.Errorf("duplicates %v, want %d", d, copiesCreate+copiesCancel-2)
	}
}

func TestCancelArrivingBeforeItsCreateIsAppliedAfterIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{})

	e.pub.publish(cancelled("202", "order-2"))
	waitFor(t, 30e9, "the early cancel to be deferred", func() bool { return deferredGap(a) > 0 })
	if _, ok := e.shipment("order-2"); ok {
		t.Fatal("the cancel was applied before its create")
	}
	e.pub.publish(created("201", "order-2"))
	s := e.waitShipment("order-2", 2)
	wantEvents(t, s, "201", "202")
	if s.Status != shipment.StatusCancelled {
		t.Errorf("status %q, want cancelled", s.Status)
	}
}

func TestManyOrdersStayInOrderAcrossTwoConsumers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{Prefetch: 16, Concurrency: 8})
	e.start(app.Config{Prefetch: 16, Concurrency: 8})

	const orders = 30
	for i := range orders {
		e.pub.publish(created(fmt.Sprint(1000+2*i), fmt.Sprintf("order-%d", i)))
		e.pub.publish(cancelled(fmt.Sprint(1001+2*i), fmt.Sprintf("order-%d", i)))
	}
	for i := range orders {
		s := e.waitShipment(fmt.Sprintf("order-%d", i), 2)
		wantEvents(t, s, fmt.Sprint(1000+2*i), fmt.Sprint(1001+2*i))
	}
	e.waitDrained(a)
	t.Logf("deferred for a gap: %v (reordering between the two consumers)", e.sum(deferredGap))
}

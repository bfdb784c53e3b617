package app_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/internal/mongolocal/replsettest"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// appSuite is run on the embedded FerretDB (standalone mode) by the Test
// functions below, and again on a replica set (transaction mode) by
// TestAppSuiteInTransactionMode.
var appSuite = map[string]func(*testing.T, *env){
	"RedeliveredMessagesProduceOneEffectWithTwoConsumers": testRedeliveredMessagesProduceOneEffectWithTwoConsumers,
	"CancelArrivingBeforeItsCreateIsAppliedAfterIt":       testCancelArrivingBeforeItsCreateIsAppliedAfterIt,
	"ManyOrdersStayInOrderAcrossTwoConsumers":             testManyOrdersStayInOrderAcrossTwoConsumers,
	"EventTypeUnknownToShippingStillAdvancesItsOrder":     testEventTypeUnknownToShippingStillAdvancesItsOrder,
	"TypelessMessageKeepsItsTypeThroughTheDelayQueue":     testTypelessMessageKeepsItsTypeThroughTheDelayQueue,
	"EffectWithoutInboxRecordIsADuplicate":                testEffectWithoutInboxRecordIsADuplicate,
	"VersionConflictIsDeadLetteredAsSuch":                 testVersionConflictIsDeadLetteredAsSuch,
}

// TestAppSuiteInTransactionMode runs appSuite with the inbox in transaction
// mode, on TEST_MONGO_REPLSET_URI or a testcontainers replica set; without
// either it skips, saying so.
func TestAppSuiteInTransactionMode(t *testing.T) {
	t.Parallel()
	replsettest.URI(t) // skips here when there is no replica set
	for name, test := range appSuite {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			test(t, newReplSetEnv(t))
		})
	}
}

func TestRedeliveredMessagesProduceOneEffectWithTwoConsumers(t *testing.T) {
	t.Parallel()
	testRedeliveredMessagesProduceOneEffectWithTwoConsumers(t, newEnv(t))
}

func testRedeliveredMessagesProduceOneEffectWithTwoConsumers(t *testing.T, e *env) {
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
	e.order.wantInOrder(t)
	if s.Status != shipment.StatusCancelled {
		t.Errorf("status %q, want %q", s.Status, shipment.StatusCancelled)
	}
	waitFor(t, 10*time.Second, "every delivery counted", func() bool {
		return e.sum(processed)+e.sum(dupInbox)+e.sum(dupVersion) >= copiesCreate+copiesCancel
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
	testCancelArrivingBeforeItsCreateIsAppliedAfterIt(t, newEnv(t))
}

func testCancelArrivingBeforeItsCreateIsAppliedAfterIt(t *testing.T, e *env) {
	a := e.start(app.Config{})

	e.pub.publish(cancelled("202", "order-2"))
	// Let the early cancel come back from the delay queue at least once.
	waitFor(t, 30*time.Second, "the early cancel handled twice", func() bool { return deferredGap(a) >= 2 || processed(a) > 0 })
	if vs := e.order.versions("order-2"); len(vs) != 0 {
		t.Fatalf("versions %v applied before the create was published", vs)
	}
	if _, ok := e.shipment("order-2"); ok {
		t.Fatal("the cancel was applied before its create")
	}
	e.pub.publish(created("201", "order-2"))
	s := e.waitShipment("order-2", 2)
	wantEvents(t, s, "201", "202")
	if s.Status != shipment.StatusCancelled {
		t.Errorf("status %q, want cancelled", s.Status)
	}
	// The order of application, not Store.Get (which stops at the first
	// missing version, and so cannot see a cancel applied without its
	// create).
	if vs := e.order.waitVersions(t, "order-2", 2); fmt.Sprint(vs) != "[1 2]" {
		t.Fatalf("application order %v, want [1 2]", vs)
	}
}

func TestManyOrdersStayInOrderAcrossTwoConsumers(t *testing.T) {
	t.Parallel()
	testManyOrdersStayInOrderAcrossTwoConsumers(t, newEnv(t))
}

func testManyOrdersStayInOrderAcrossTwoConsumers(t *testing.T, e *env) {
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
	e.order.wantInOrder(t)
	t.Logf("deferred for a gap: %v (reordering between the two consumers)", e.sum(deferredGap))
}

// TestOneProcessHandlesAnOrdersChainInOrder publishes chains of versions
// back to back, so that several of one order's versions are in one
// consumer's prefetch window at once: the workers of one process must take
// an order's deliveries one after the other, in delivery order, never two
// at once, so that none finds its predecessor still being applied by
// another worker and goes round through the delay queue.
func TestOneProcessHandlesAnOrdersChainInOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{Prefetch: 64, Concurrency: 8})

	const orders, chain = 24, 8
	for i := range orders {
		id := fmt.Sprintf("chain-%d", i)
		e.pub.publish(created(chainMsgID(i, 1), id))
		for v := 2; v < chain; v++ {
			e.pub.publish(amended(chainMsgID(i, v), id, int64(v)))
		}
		cancel := cancelled(chainMsgID(i, chain), id)
		cancel.Version = int64(chain)
		e.pub.publish(cancel)
	}
	for i := range orders {
		s := e.waitShipment(fmt.Sprintf("chain-%d", i), chain)
		var want []string
		for v := 1; v <= chain; v++ {
			want = append(want, chainMsgID(i, v))
		}
		wantEvents(t, s, want...)
	}
	e.waitDrained(a)
	e.order.wantInOrder(t)
	if g := deferredGap(a); g != 0 {
		t.Errorf("%v deliveries deferred for a gap; want 0: one process takes an order's deliveries in order", g)
	}
}

func chainMsgID(order, version int) string { return fmt.Sprint(50000 + 100*order + version) }

package app_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/mongolocal"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/processor"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// crashAt arms point so that its first hit "kills" the consumer there: the
// broker cuts the vhost's connections (the delivery is abandoned unacked,
// as when the process dies) and the handling goroutine stops on the spot.
func (e *env) crashAt(point string) (*crashpoint.Trigger, <-chan struct{}) {
	fired := make(chan struct{})
	return crashpoint.New(point, 1, func() {
		if err := amqptest.TryCloseConnections(context.WithoutCancel(e.t.Context()), e.vhost); err != nil {
			e.t.Errorf("cut connections: %v", err)
		}
		close(fired)
		runtime.Goexit()
	}), fired
}

func TestCrashBetweenEffectAndInboxRecordStillOneEffect(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	crash, fired := e.crashAt(crashpoint.ShippingAfterEffectBeforeInbox)
	a := e.start(app.Config{Crash: crash})

	e.pub.publish(created("301", "order-3"))
	<-fired
	s := e.waitShipment("order-3", 1)
	e.waitDrained(a)
	wantEvents(t, s, "301")
	// The redelivery found no inbox record, ran the handler again, and the
	// store recognised the version: one effect, counted as a duplicate.
	waitFor(t, 10*time.Second, "the redelivery to be counted", func() bool { return dupVersion(a) == 1 })
	done, err := e.inbox.IsDone(t.Context(), "301")
	if err != nil || !done {
		t.Fatalf("inbox record for 301: done=%v, %v", done, err)
	}
}

func TestCrashBetweenInboxRecordAndAckStillOneEffect(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	crash, fired := e.crashAt(crashpoint.ShippingAfterInboxBeforeAck)
	a := e.start(app.Config{Crash: crash})

	e.pub.publish(created("401", "order-4"))
	<-fired
	s := e.waitShipment("order-4", 1)
	e.waitDrained(a)
	wantEvents(t, s, "401")
	waitFor(t, 10*time.Second, "the redelivery to be counted", func() bool { return dupInbox(a) == 1 })
	if p := processed(a); p != 1 {
		t.Fatalf("processed %v, want 1", p)
	}
}

// failingStore fails every Apply for orders whose id starts with "poison".
type failingStore struct{ processor.Store }

func (f failingStore) Apply(ctx context.Context, msgID string, ev shipment.Event) (shipment.Outcome, error) {
	if strings.HasPrefix(ev.OrderID, "poison") {
		return 0, errors.New("simulated handler bug")
	}
	return f.Store.Apply(ctx, msgID, ev)
}

func TestPoisonMessagesAreDeadLetteredWithTheirReasonWhileOthersFlow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{
		MaxAttempts: 3,
		WrapStore:   func(s processor.Store) processor.Store { return failingStore{s} },
	})

	good := func(i int) { e.pub.publish(created(fmt.Sprint(500+i), fmt.Sprintf("good-%d", i))) }
	good(0)
	malformed := created("601", "order-bad-json")
	malformed.Body = []byte(`{"order_id": "order-bad-json",`)
	e.pub.publish(malformed)
	good(1)
	noID := created("", "order-no-id")
	e.pub.publish(noID)
	good(2)
	badVersion := created("602", "order-bad-version")
	badVersion.Version = "one"
	e.pub.publish(badVersion)
	noVersion := created("603", "order-no-version")
	noVersion.Version = nil
	e.pub.publish(noVersion)
	good(3)
	e.pub.publish(created("604", "poison-1"))
	unknown := created("605", "order-unknown")
	unknown.Type = "order.shipped"
	e.pub.publish(unknown)
	good(4)

	for i := range 5 {
		e.waitShipment(fmt.Sprintf("good-%d", i), 1)
	}
	top := a.Topology()
	want := map[string]string{ // message id -> reason
		"601": "malformed_payload",
		"":    "missing_message_id",
		"602": "invalid_version",
		"603": "invalid_version",
		"604": "handler_failed",
	}
	var dead []amqp.Delivery
	waitFor(t, 30*time.Second, "5 dead letters", func() bool {
		dead = append(dead, e.deadLetters(top.DeadLetterQueue)...)
		return len(dead) >= len(want)
	})
	e.waitDrained(a)
	dead = append(dead, e.deadLetters(top.DeadLetterQueue)...)
	if len(dead) != len(want) {
		t.Fatalf("%d dead letters, want %d", len(dead), len(want))
	}
	for _, d := range dead {
		reason, _ := d.Headers[shipment.HeaderReason].(string)
		detail, _ := d.Headers[shipment.HeaderError].(string)
		if reason != want[d.MessageId] || detail == "" {
			t.Errorf("dead letter %q: reason %q (error %q), want reason %q with an error", d.MessageId, reason, detail, want[d.MessageId])
		}
		if d.Headers[shipment.HeaderOriginalExchange] != "orders.events" {
			t.Errorf("dead letter %q: original exchange %v", d.MessageId, d.Headers[shipment.HeaderOriginalExchange])
		}
		t.Logf("dead letter %q: %s: %s", d.MessageId, reason, detail)
	}
	if _, ok := e.shipment("order-unknown"); ok {
		t.Error("an unknown event type was applied")
	}
	if n := value(a.Metrics().UnknownType); n != 1 {
		t.Errorf("unknown-type count %v, want 1 (acked and logged, not dead-lettered)", n)
	}
	wantCounted(t, "dead-lettered{handler_failed}", a.Metrics().DeadLettered.WithLabelValues("handler_failed"), 1)
}

func TestBrokerConnectionCutsMidStreamLoseNothingAndAckNoStaleDelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{Prefetch: 20, Concurrency: 4})
	b := e.start(app.Config{Prefetch: 20, Concurrency: 4})

	const orders = 80
	t0 := time.Now()
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range orders {
			e.pub.publish(created(fmt.Sprint(10000+2*i), fmt.Sprintf("o-%d", i)))
			e.pub.publish(cancelled(fmt.Sprint(10001+2*i), fmt.Sprintf("o-%d", i)))
		}
	})
	for _, at := range []float64{40, 100} {
		waitFor(t, 60*time.Second, fmt.Sprintf("%v events processed", at), func() bool { return e.sum(processed) >= at })
		amqptest.CloseConnections(t, e.vhost)
		t.Logf("%v cut connections after %v events", time.Since(t0), at)
	}
	wg.Wait()
	t.Logf("%v published", time.Since(t0))
	for i := range orders {
		s := e.waitShipment(fmt.Sprintf("o-%d", i), 2)
		wantEvents(t, s, fmt.Sprint(10000+2*i), fmt.Sprint(10001+2*i))
	}
	t.Logf("%v all applied", time.Since(t0))
	e.waitDrained(a)
	t.Logf("%v drained", time.Since(t0))
	waitFor(t, 30*time.Second, "both consumers back", func() bool { return a.Ready() == nil && b.Ready() == nil })
	if c := value(a.Metrics().BrokerConnections) + value(b.Metrics().BrokerConnections); c < 6 {
		t.Errorf("%v broker connections over both consumers, want at least 6 (two cuts)", c)
	}
	logs := e.logs.String()
	for _, bad := range []string{"PRECONDITION_FAILED", "unknown delivery tag"} {
		if strings.Contains(logs, bad) {
			t.Errorf("logs mention %q: a delivery was acked on the wrong channel", bad)
		}
	}
	if dl := e.deadLetters(a.Topology().DeadLetterQueue); len(dl) != 0 {
		t.Errorf("%d dead letters after connection cuts, want none", len(dl))
	}
	t.Logf("processed %v, duplicates inbox %v version %v, deferred for a gap %v",
		e.sum(processed), e.sum(dupInbox), e.sum(dupVersion), e.sum(deferredGap))
	for i, x := range []*app.App{a, b} {
		var m dto.Metric
		_ = x.Metrics().HandlerDuration.Write(&m)
		t.Logf("consumer %d: %d deliveries handled, mean %.1fms", i, m.GetHistogram().GetSampleCount(),
			1000*m.GetHistogram().GetSampleSum()/float64(max(1, m.GetHistogram().GetSampleCount())))
	}
}

func TestMongoOutageKeepsDeliveriesWithoutBurningTheDeliveryLimit(t *testing.T) {
	t.Parallel()
	vhost, amqpURL := amqptest.VHost(t)
	dir := t.TempDir()
	srv, err := mongolocal.Start(t.Context(), mongolocal.Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	addr := srv.Addr()
	e := &env{t: t, vhost: vhost, amqpURL: amqpURL, mongoURI: srv.URI() + "shipping", logs: &logBuffer{}}
	e.pub = newPublisher(t, amqpURL)
	a := e.start(app.Config{Topology: rabbitmq.Topology{DeliveryLimit: 2}, MongoServerSelectionTimeout: time.Second})

	e.pub.publish(created("701", "order-7"))
	waitFor(t, 30*time.Second, "the first event applied", func() bool { return processed(a) == 1 })

	// MongoDB goes away (the service's client is still connected: Close
	// waits up to 3s for it).
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	e.pub.publish(cancelled("702", "order-7"))
	waitFor(t, 60*time.Second, "the consumer to notice the outage", func() bool {
		return value(a.Metrics().MongoUnavailable) >= 2
	})
	if ready, unacked := amqptest.QueueCounts(t, vhost, a.Topology().Queue); ready != 0 || unacked != 1 {
		t.Fatalf("during the outage: %d ready, %d unacked; want the delivery held (0, 1)", ready, unacked)
	}

	srv2, err := mongolocal.Start(t.Context(), mongolocal.Config{Addr: addr, DataDir: dir})
	if err != nil {
		t.Fatalf("restart FerretDB on %s: %v", addr, err)
	}
	t.Cleanup(func() { _ = srv2.Close() })
	waitFor(t, 60*time.Second, "the held event applied", func() bool { return processed(a) == 2 })
	e.waitDrained(a)

	client, err := mongo.Connect(options.Client().ApplyURI(srv2.URI()))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Disconnect(context.WithoutCancel(t.Context()))
	store, _ := mongodb.New(client.Database("shipping"), "")
	s, err := store.Get(t.Context(), "order-7")
	if err != nil {
		t.Fatal(err)
	}
	wantEvents(t, s, "701", "702")
	// Held, not requeued: with a delivery limit of 2, requeueing through the
	// outage would have dead-lettered it.
	if dl := e.deadLetters(a.Topology().DeadLetterQueue); len(dl) != 0 {
		t.Fatalf("%d dead letters: the outage burnt the delivery limit", len(dl))
	}
}

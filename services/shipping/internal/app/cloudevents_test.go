package app_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Events the orders relay publishes in the CloudEvents envelope
// (outboxamqp's Config.CloudEvents) are applied as those of the outbox
// envelope: once each, in version order (the cancel that arrives first
// waits in the delay queue, its attributes intact), a second copy of either
// is a duplicate, and so is a copy in the other envelope, since both carry
// the outbox id. A message that claims the CloudEvents envelope without
// being a valid event goes to the dead-letter queue as invalid_cloudevent.
func TestCloudEventsAreAppliedOnceWhicheverEnvelope(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{})

	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{
		URL: e.amqpURL, Exchange: "orders.events", DialTimeout: 5 * time.Second,
		CloudEvents: &outboxamqp.CloudEvents{Source: "/orders"}, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	publish := func(evs ...event) {
		t.Helper()
		envs := make([]outbox.Envelope, len(evs))
		for i, ev := range evs {
			// The same message id as the outbox envelope of the event.
			id, createdAt, err := outbox.ParseMessageID(ev.MessageID)
			if err != nil {
				t.Fatal(err)
			}
			envs[i] = outbox.Envelope{
				ID: id, AggregateType: "order", AggregateID: ev.OrderID, AggregateVersion: ev.Version.(int64),
				EventType: ev.Type, Payload: ev.Body, Headers: map[string]string{}, CreatedAt: createdAt,
			}
		}
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		if err := pub.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		for i, err := range pub.PublishBatch(ctx, envs) {
			if err != nil {
				t.Fatalf("publish %s: %v", evs[i].MessageID, err)
			}
		}
	}

	now := time.Now()
	id1, id2, id3 := outbox.MessageID(1001, now), outbox.MessageID(1002, now), outbox.MessageID(1003, now)
	publish(cancelled(id2, "o-ce")) // before its create: deferred
	waitFor(t, 30*time.Second, "the cancel deferred", func() bool { return e.sum(deferredGap) >= 1 })
	publish(created(id1, "o-ce"))
	wantEvents(t, e.waitShipment("o-ce", 2), id1, id2)

	publish(created(id1, "o-ce"))         // the relay publishing it again
	e.pub.publish(cancelled(id2, "o-ce")) // the outbox envelope of the same event
	invalid := created(id3, "o-ce-invalid")
	invalid.Headers = map[string]any{"cloudEvents_id": id3} // no specversion, source, type
	e.pub.publish(invalid)
	e.waitDrained(a)

	if got := e.sum(dupInbox) + e.sum(dupVersion); got != 2 {
		t.Errorf("duplicates %v, want 2 (the second copy of each event)", got)
	}
	if got := e.sum(processed); got != 2 {
		t.Errorf("applied %v events, want 2", got)
	}
	wantEvents(t, e.waitShipment("o-ce", 2), id1, id2)
	if _, ok := e.shipment("o-ce-invalid"); ok {
		t.Error("the invalid CloudEvents message was applied")
	}
	dead := e.deadLetters(a.Topology().DeadLetterQueue)
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	reason, _ := dead[0].Headers[shipment.HeaderReason].(string)
	detail, _ := dead[0].Headers[shipment.HeaderError].(string)
	if reason != string(shipment.ReasonInvalidCloudEvent) || detail == "" || dead[0].MessageId != id3 {
		t.Errorf("dead letter %q: reason %q (%q), want %s with its error", dead[0].MessageId, reason, detail, shipment.ReasonInvalidCloudEvent)
	}
	t.Logf("dead letter: %s: %s", reason, detail)
	wantCounted(t, "dead-lettered{invalid_cloudevent}", a.Metrics().DeadLettered.WithLabelValues(string(shipment.ReasonInvalidCloudEvent)), 1)
}

package outboxamqp_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

func envelope(id int64, agg string, version int64, eventType string) outbox.Envelope {
	return outbox.Envelope{
		ID:               id,
		AggregateType:    "order",
		AggregateID:      agg,
		AggregateVersion: version,
		EventType:        eventType,
		Payload:          []byte(`{"order_id":"` + agg + `"}`),
		Headers:          map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "aggregate_id": "spoofed"},
		CreatedAt:        time.Date(2026, 11, 29, 22, 0, 0, 0, time.UTC),
		Attempt:          1,
	}
}

func publishBatch(t *testing.T, p *outboxamqp.Publisher, msgs ...outbox.Envelope) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		t.Fatalf("WaitReady: %v", err)
	}
	errs := p.PublishBatch(ctx, msgs)
	if len(errs) != len(msgs) {
		t.Fatalf("%d results for %d messages", len(errs), len(msgs))
	}
	return errs
}

// The message on the wire is what docs/events.md specifies.
func TestPublishBatchSendsTheContractedMessage(t *testing.T) {
	t.Parallel()
	b := newBroker(t, true)
	p := newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil))

	errs := publishBatch(t, p, envelope(41, "o-1", 1, "order.created"), envelope(42, "o-1", 2, "order.cancelled"))
	for i, err := range errs {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	ds := b.WaitDeliveries("two messages", 10*time.Second, func(ds []amqp.Delivery) bool { return len(ds) == 2 })
	for i, d := range ds {
		wantID, wantVersion, wantType := int64(41+i), int64(1+i), []string{"order.created", "order.cancelled"}[i]
		if d.MessageId != outbox.MessageID(wantID, time.Date(2026, 11, 29, 22, 0, 0, 0, time.UTC)) || d.Type != wantType || d.RoutingKey != wantType ||
			d.ContentType != "application/json" || d.DeliveryMode != amqp.Persistent ||
			!d.Timestamp.Equal(time.Date(2026, 11, 29, 22, 0, 0, 0, time.UTC)) || string(d.Body) != `{"order_id":"o-1"}` {
			t.Errorf("delivery %d properties: id %q type %q key %q content %q mode %d ts %v body %s",
				i, d.MessageId, d.Type, d.RoutingKey, d.ContentType, d.DeliveryMode, d.Timestamp, d.Body)
		}
		want := amqp.Table{
			"aggregate_type":    "order",
			"aggregate_id":      "o-1", // the outbox's own field wins over a same-named free header
			"event_type":        wantType,
			"aggregate_version": wantVersion,
			"outbox_created_at": "2026-11-29T22:00:00Z",
			"traceparent":       "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		}
		if len(d.Headers) != len(want) {
			t.Errorf("delivery %d headers %v, want %v", i, d.Headers, want)
		}
		for k, v := range want {
			if d.Headers[k] != v {
				t.Errorf("delivery %d header %s = %#v (%T), want %#v (%T)", i, k, d.Headers[k], d.Headers[k], v, v)
			}
		}
	}
}

func TestPublishBatchReportsReturnedAndNackedMessagesAsFailed(t *testing.T) {
	t.Parallel()
	b := newBroker(t, false)
	// Only order.created is routed, to a queue that holds one message and then
	// makes the broker nack further publishes.
	b.bind("order.created", amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	p := newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil))

	errs := publishBatch(t, p,
		envelope(1, "o-1", 1, "order.created"),   // routed, queued
		envelope(2, "o-2", 1, "order.cancelled"), // no queue bound: returned
		envelope(3, "o-3", 1, "order.created"),   // routed, queue full: nacked
	)
	if errs[0] != nil {
		t.Errorf("routed message: %v", errs[0])
	}
	if !errors.Is(errs[1], outbox.ErrUnroutable) {
		t.Errorf("unroutable message: %v, want ErrUnroutable", errs[1])
	}
	if errs[2] == nil || errors.Is(errs[2], outbox.ErrUnroutable) || errors.Is(errs[2], outbox.ErrNotSent) {
		t.Errorf("nacked message: %v, want a plain failure", errs[2])
	}
}

func TestPublishBatchWithoutConnectionIsNotSent(t *testing.T) {
	t.Parallel()
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: "amqp://guest:guest@127.0.0.1:1/", Exchange: "x", Logger: testLogger(t, nil)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	errs := p.PublishBatch(context.Background(), []outbox.Envelope{envelope(1, "o-1", 1, "order.created")})
	if !errors.Is(errs[0], outbox.ErrNotSent) {
		t.Fatalf("publish before connecting: %v, want ErrNotSent", errs[0])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := p.WaitReady(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitReady on a closed port: %v, want the context's deadline", err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitReady(context.Background()); !errors.Is(err, outboxamqp.ErrClosed) {
		t.Fatalf("WaitReady after Close: %v, want ErrClosed", err)
	}
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]outboxamqp.Config{
		"no URL":              {Exchange: "x"},
		"bad URL":             {URL: "http://nope", Exchange: "x"},
		"no exchange":         {URL: "amqp://localhost/"},
		"negative timeout":    {URL: "amqp://localhost/", Exchange: "x", DialTimeout: -1},
		"reconnect min > max": {URL: "amqp://localhost/", Exchange: "x", ReconnectMin: time.Minute, ReconnectMax: time.Second},
		"negative in flight":  {URL: "amqp://localhost/", Exchange: "x", MaxInFlight: -1},
	} {
		if _, err := outboxamqp.NewPublisher(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// Confirms that do not come back by the deadline make PublishBatch return on
// time, with an outcome-unknown failure (not ErrNotSent: the broker may have
// the messages). The batch's channel is closed; here the broker does not
// answer that either (nothing it sends comes through), so the connection is
// dropped, and the publisher reconnects for the next batch.
func TestPublishBatchWithoutConfirmsByTheDeadline(t *testing.T) {
	t.Parallel()
	b := newBroker(t, true)
	px := newProxy(t)
	p := newPublisher(t, px.URL(t), b.Exchange, testLogger(t, nil))
	if errs := publishBatch(t, p, envelope(1, "o-1", 1, "order.created")); errs[0] != nil {
		t.Fatal(errs[0])
	}

	px.DropReplies(true)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	errs := p.PublishBatch(ctx, []outbox.Envelope{envelope(2, "o-2", 1, "order.created"), envelope(3, "o-3", 1, "order.created")})
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("PublishBatch took %v past a 300ms deadline", d)
	}
	for i, err := range errs {
		if err == nil || errors.Is(err, outbox.ErrNotSent) {
			t.Fatalf("message %d: %v, want an outcome-unknown failure", i, err)
		}
	}
	b.WaitDeliveries("the unconfirmed messages routed anyway", 10*time.Second, func(ds []amqp.Delivery) bool { return len(ds) == 3 })
	waitUntil(t, "the unanswering connection dropped", func() bool { return p.Ready() != nil })

	px.DropReplies(false)
	if errs := publishBatch(t, p, envelope(4, "o-4", 1, "order.created")); errs[0] != nil {
		t.Fatalf("after the timeout, a new connection publishes: %v", errs[0])
	}
}

// Ready answers at once whether the publisher holds a live connection: not
// before the first WaitReady, yes once connected, no (with the cause) as soon
// as the connection is cut and while the broker cannot be reached, yes again
// after WaitReady reconnected, and ErrClosed after Close.
func TestReadyReportsTheConnection(t *testing.T) {
	t.Parallel()
	b := newBroker(t, true)
	px := newProxy(t)
	p := newPublisher(t, px.URL(t), b.Exchange, testLogger(t, nil))
	if err := p.Ready(); !errors.Is(err, outboxamqp.ErrNotConnected) {
		t.Fatalf("Ready before connecting: %v, want ErrNotConnected", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Ready(); err != nil {
		t.Fatalf("Ready when connected: %v", err)
	}

	px.Stop() // every connection cut, nothing listening
	waitFor(t, "Ready to see the cut", 10*time.Second, func() (bool, error) {
		return errors.Is(p.Ready(), outboxamqp.ErrNotConnected), nil
	})
	// A failed attempt to reconnect is named too.
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	if err := p.WaitReady(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitReady while the broker is unreachable: %v", err)
	}
	// The attempt fails as "connection refused", or, when the dial was still
	// under way as WaitReady's deadline came, as a dial timeout.
	if err := p.Ready(); !errors.Is(err, outboxamqp.ErrNotConnected) || !strings.Contains(err.Error(), "(last attempt: dial") {
		t.Fatalf("Ready while the broker is unreachable: %v, want ErrNotConnected naming the failed attempt", err)
	}

	if err := px.Start(); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Ready(); err != nil {
		t.Fatalf("Ready after reconnecting: %v", err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Ready(); !errors.Is(err, outboxamqp.ErrClosed) {
		t.Fatalf("Ready after Close: %v, want ErrClosed", err)
	}
}

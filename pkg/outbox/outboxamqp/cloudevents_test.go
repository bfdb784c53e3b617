package outboxamqp_test

import (
	"errors"
	"maps"
	"math"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

func newCloudEventsPublisher(t *testing.T, exchange string, ce *outboxamqp.CloudEvents) *outboxamqp.Publisher {
	t.Helper()
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{
		URL: testAMQPURL(), Exchange: exchange, DialTimeout: 2 * time.Second,
		Logger: testLogger(t, nil), CloudEvents: ce,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// With Config.CloudEvents, what a consumer takes off the queue is a
// CloudEvents 1.0 event in the AMQP binding's binary content mode: each
// attribute in its cloudEvents_ header, with its value and AMQP type, the
// data content type in the content-type property, the payload as the body;
// the free headers (trace context and baggage) stay as they were, and the
// outbox envelope's own headers are not sent.
func TestCloudEventsEnvelopeReachesTheConsumerAttributeByAttribute(t *testing.T) {
	t.Parallel()
	b := newBroker(t, true)
	p := newCloudEventsPublisher(t, b.Exchange, &outboxamqp.CloudEvents{Source: "/orders"})

	e := envelope(42, "o-1", 3, "order.cancelled")
	e.CreatedAt = time.Date(2026, 11, 29, 22, 0, 1, 123456000, time.FixedZone("CET", 3600))
	e.Headers["tracestate"] = "congo=t61rcWkgMzE"
	e.Headers["baggage"] = "tenant=acme"
	e.Headers["aggregate_version"] = "spoofed"
	if errs := publishBatch(t, p, e); errs[0] != nil {
		t.Fatalf("publish: %v", errs[0])
	}
	d := b.WaitDeliveries("the event", 10*time.Second, func(ds []amqp.Delivery) bool { return len(ds) == 1 })[0]

	want := amqp.Table{
		"cloudEvents_specversion":      "1.0",
		"cloudEvents_id":               e.MessageID(),
		"cloudEvents_source":           "/orders",
		"cloudEvents_type":             "order.cancelled",
		"cloudEvents_subject":          "o-1",
		"cloudEvents_time":             "2026-11-29T21:00:01.123456Z",
		"cloudEvents_aggregatetype":    "order",
		"cloudEvents_aggregateversion": int64(3),
		"cloudEvents_traceparent":      "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"cloudEvents_tracestate":       "congo=t61rcWkgMzE",
		// The transport's own trace headers, and the rest of the row's.
		"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
		"tracestate":  "congo=t61rcWkgMzE",
		"baggage":     "tenant=acme",
	}
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if got, ok := d.Headers[k]; !ok || got != want[k] {
			t.Errorf("header %s = %#v (present %v), want %#v", k, got, ok, want[k])
		}
	}
	for k := range d.Headers {
		if _, ok := want[k]; !ok {
			t.Errorf("unexpected header %s = %#v", k, d.Headers[k])
		}
	}
	if d.ContentType != "application/json" {
		t.Errorf("content type (datacontenttype) %q", d.ContentType)
	}
	if d.MessageId != e.MessageID() || d.Type != "order.cancelled" || d.DeliveryMode != amqp.Persistent || !d.Timestamp.Equal(e.CreatedAt.Truncate(time.Second)) {
		t.Errorf("properties: message id %q, type %q, delivery mode %d, timestamp %v", d.MessageId, d.Type, d.DeliveryMode, d.Timestamp)
	}
	if string(d.Body) != string(e.Payload) {
		t.Errorf("body %s, want the payload %s", d.Body, e.Payload)
	}
	if d.RoutingKey != "order.cancelled" {
		t.Errorf("routing key %q", d.RoutingKey)
	}
}

// The binding's example of a binary-mode message (AMQP protocol binding,
// 3.1.4), with the '_' separator: the attributes it shows come out as it
// shows them, values and all. Its id, 1234-1234-1234, is no outbox id; the
// outbox's are decimal. Every attribute name is one the core specification
// allows (lower-case letters and digits, at most 20 characters), and
// datacontenttype travels as the content-type property, never as a header.
func TestCloudEventsPublishingFollowsTheBindingsExample(t *testing.T) {
	t.Parallel()
	e := outbox.Envelope{
		ID: 1234, AggregateType: "thing", AggregateID: "t-1", AggregateVersion: 1,
		EventType: "com.example.someevent", Payload: []byte(`{"a":1}`), Headers: map[string]string{},
		CreatedAt: time.Date(2018, 4, 5, 3, 56, 24, 0, time.UTC),
	}
	m, err := outboxamqp.CloudEventsPublishing(e, outboxamqp.CloudEvents{Source: "/mycontext/subcontext"})
	if err != nil {
		t.Fatal(err)
	}
	example := map[string]string{ // from the binding's example
		"cloudEvents_specversion": "1.0",
		"cloudEvents_type":        "com.example.someevent",
		"cloudEvents_time":        "2018-04-05T03:56:24Z",
		"cloudEvents_source":      "/mycontext/subcontext",
	}
	for k, v := range example {
		if m.Headers[k] != v {
			t.Errorf("%s = %#v, want %q", k, m.Headers[k], v)
		}
	}
	if m.Headers["cloudEvents_id"] != "1234-1522900584000000" || m.MessageId != m.Headers["cloudEvents_id"] {
		t.Errorf("id %#v", m.Headers["cloudEvents_id"])
	}
	if !strings.HasPrefix(m.ContentType, "application/json") {
		t.Errorf("content-type %q, want the JSON data's media type", m.ContentType)
	}
	name := regexp.MustCompile(`^[a-z0-9]{1,20}$`)
	for k := range m.Headers {
		attr, ok := strings.CutPrefix(k, "cloudEvents_")
		if !ok {
			t.Errorf("header %s outside the CloudEvents attributes (this envelope has no free headers)", k)
			continue
		}
		if !name.MatchString(attr) || attr == "datacontenttype" {
			t.Errorf("attribute %q: not a name the binary mode carries in application properties", attr)
		}
		if strings.Contains(k, ":") {
			t.Errorf("header %s mixes separators", k)
		}
	}
	// Without a trace context, the tracing extension is absent, not empty.
	for _, k := range []string{outboxamqp.HeaderCETraceparent, outboxamqp.HeaderCETracestate} {
		if _, ok := m.Headers[k]; ok {
			t.Errorf("%s set without a trace context", k)
		}
	}
}

// A message that cannot be a CloudEvents event fails by itself, as a
// counted attempt (never ErrNotSent, which would retry it forever), while
// its batch-mates are published; a Config without a usable source is
// refused by New.
func TestCloudEventsRefusesWhatCannotBeAnEvent(t *testing.T) {
	t.Parallel()
	for name, ce := range map[string]outboxamqp.CloudEvents{
		"no source":    {},
		"space":        {Source: "/my source"},
		"bad escape":   {Source: "/%zz"},
		"too long":     {Source: "/" + strings.Repeat("s", 1024)},
		"invalid utf8": {Source: "/\xff"},
	} {
		if _, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: "amqp://localhost/", Exchange: "x", CloudEvents: &ce}); err == nil {
			t.Errorf("New with source %s: accepted", name)
		}
	}

	b := newBroker(t, true)
	p := newCloudEventsPublisher(t, b.Exchange, &outboxamqp.CloudEvents{Source: "urn:example:orders"})
	tooHigh := envelope(1, "o-1", math.MaxInt32+1, "order.created")
	colon := envelope(2, "o-2", 1, "order.created")
	colon.Headers["cloudEvents:partitionkey"] = "k"
	upper := envelope(3, "o-3", 1, "order.created")
	upper.Headers["CLOUDEVENTS_id"] = "other"
	good := envelope(4, "o-4", 1, "order.created")
	errs := publishBatch(t, p, tooHigh, colon, upper, good)
	for i, err := range errs[:3] {
		if err == nil || errors.Is(err, outbox.ErrNotSent) || errors.Is(err, outbox.ErrBatchRefused) {
			t.Errorf("message %d: %v, want a failure of its own", i+1, err)
		}
	}
	if errs[3] != nil {
		t.Fatalf("the valid message: %v", errs[3])
	}
	ds := b.WaitDeliveries("the valid message", 10*time.Second, func(ds []amqp.Delivery) bool { return len(ds) >= 1 })
	if len(ds) != 1 || ds[0].MessageId != good.MessageID() {
		t.Fatalf("delivered %d messages, first %q; want only message 4", len(ds), ds[0].MessageId)
	}
	// The largest version a CloudEvents Integer holds goes out.
	if _, err := outboxamqp.CloudEventsPublishing(envelope(5, "o-5", math.MaxInt32, "order.created"), outboxamqp.CloudEvents{Source: "/o"}); err != nil {
		t.Errorf("version 2^31-1: %v", err)
	}
}

// A message that cannot be sent holds back the rest of its run: sending
// them would put them before it. They are not sent (ErrNotSent, no attempt
// counted; the relay sends them after it), while other aggregates' go.
func TestCloudEventsRefusedEventHoldsBackItsRun(t *testing.T) {
	t.Parallel()
	b := newBroker(t, true)
	p := newCloudEventsPublisher(t, b.Exchange, &outboxamqp.CloudEvents{Source: "urn:example:orders"})
	refused := envelope(1, "o-1", 9, "order.amended")
	refused.Headers["cloudEvents:partitionkey"] = "k"
	behind := envelope(2, "o-1", 10, "order.amended")
	other := envelope(3, "o-2", 1, "order.created")
	errs := publishBatch(t, p, refused, behind, other)
	if errs[0] == nil || errors.Is(errs[0], outbox.ErrNotSent) {
		t.Errorf("the refused message: %v, want a failure of its own", errs[0])
	}
	if !errors.Is(errs[1], outbox.ErrNotSent) {
		t.Errorf("the next version of its aggregate: %v, want ErrNotSent", errs[1])
	}
	if errs[2] != nil {
		t.Fatalf("another aggregate's message: %v", errs[2])
	}
	// One channel, one queue: had version 10 gone out, it would come first.
	ds := b.WaitDeliveries("the other aggregate's message", 10*time.Second, func(ds []amqp.Delivery) bool { return len(ds) >= 1 })
	if len(ds) != 1 || ds[0].MessageId != other.MessageID() {
		t.Fatalf("delivered %d messages, first %q; want only message 3", len(ds), ds[0].MessageId)
	}
}

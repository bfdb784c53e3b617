package shipment_test

import (
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// bindingExample is the binary-mode example of the CloudEvents AMQP
// protocol binding (3.1.4), its attributes under the separator sep, with
// the extension attributes shipping needs to place an event in its order
// (subject, aggregateversion).
func bindingExample(sep string) shipment.Message {
	return shipment.Message{
		ContentType: "application/json; charset=utf-8",
		RoutingKey:  "myqueue",
		Headers: map[string]any{
			"cloudEvents" + sep + "specversion":      "1.0",
			"cloudEvents" + sep + "type":             "com.example.someevent",
			"cloudEvents" + sep + "time":             "2018-04-05T03:56:24Z",
			"cloudEvents" + sep + "id":               "1234-1234-1234",
			"cloudEvents" + sep + "source":           "/mycontext/subcontext",
			"cloudEvents" + sep + "subject":          "o-1",
			"cloudEvents" + sep + "aggregateversion": int64(2),
		},
		Body: []byte(`{"order_id":"o-1"}`),
	}
}

// The binding's example reads as what it says, under either separator the
// binding allows: an event of a type shipping does not handle, placed at
// its order and version, deduplicated by its id, created at its time.
func TestDecodeReadsTheBindingsBinaryExample(t *testing.T) {
	for _, sep := range []string{"_", ":"} {
		m := bindingExample(sep)
		ev, err := shipment.Decode(m)
		if err != nil {
			t.Fatalf("separator %q: %v", sep, err)
		}
		want := shipment.Event{Type: "com.example.someevent", OrderID: "o-1", Version: 2, Ignored: true}
		if ev != want {
			t.Errorf("separator %q: %+v, want %+v", sep, ev, want)
		}
		if id := shipment.MessageID(m); id != "1234-1234-1234" {
			t.Errorf("separator %q: message id %q, want the id attribute", sep, id)
		}
		if created, ok := shipment.CreatedAt(m.Headers); !ok || !created.Equal(time.Date(2018, 4, 5, 3, 56, 24, 0, time.UTC)) {
			t.Errorf("separator %q: created at %v, %v", sep, created, ok)
		}
		if o, v, ok := shipment.Locate(m); !ok || o != "o-1" || v != 2 {
			t.Errorf("separator %q: Locate = %q, %d, %v", sep, o, v, ok)
		}
	}
	// The binding's structured-mode example is recognised, and refused:
	// shipping takes the binary mode only.
	structured := shipment.Message{
		ContentType: "application/cloudevents+json; charset=utf-8",
		MessageID:   "1", Headers: map[string]any{"aggregate_id": "o-1", "aggregate_version": int64(1)},
		Body: []byte(`{"specversion":"1.0","type":"com.example.someevent","data":{}}`),
	}
	var inv *shipment.InvalidError
	if _, err := shipment.Decode(structured); !errors.As(err, &inv) || inv.Reason != shipment.ReasonInvalidCloudEvent {
		t.Errorf("structured mode: %v, want %s", err, shipment.ReasonInvalidCloudEvent)
	}
}

// What outboxamqp publishes with Config.CloudEvents decodes to the same
// event as its outbox envelope (the default), and the binding's other
// value forms (an AMQP timestamp, an integer of another width, the
// canonical string) read the same.
func TestDecodeReadsBothEnvelopesOfAnOutboxEventAlike(t *testing.T) {
	e := outbox.Envelope{
		ID: 7, AggregateType: "order", AggregateID: "o-1", AggregateVersion: 1, EventType: shipment.TypeCreated,
		Payload: []byte(createdBody), Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		CreatedAt: time.Date(2026, 11, 29, 22, 0, 0, 123456000, time.UTC),
	}
	message := func(p amqp.Publishing) shipment.Message {
		return shipment.Message{MessageID: p.MessageId, Type: p.Type, ContentType: p.ContentType, RoutingKey: e.EventType, Headers: p.Headers, Body: p.Body}
	}
	plain, err := shipment.Decode(message(outboxamqp.Publishing(e)))
	if err != nil {
		t.Fatal(err)
	}
	p, err := outboxamqp.CloudEventsPublishing(e, outboxamqp.CloudEvents{Source: "/orders"})
	if err != nil {
		t.Fatal(err)
	}
	variants := map[string]func(m *shipment.Message){
		"as published":        func(*shipment.Message) {},
		"no MessageId":        func(m *shipment.Message) { m.MessageID = "" },
		"no type property":    func(m *shipment.Message) { m.Type = "" },
		"timestamp time":      func(m *shipment.Message) { m.Headers["cloudEvents_time"] = e.CreatedAt.Truncate(time.Second) },
		"string version":      func(m *shipment.Message) { m.Headers["cloudEvents_aggregateversion"] = "1" },
		"int32 version":       func(m *shipment.Message) { m.Headers["cloudEvents_aggregateversion"] = int32(1) },
		"legacy headers lost": func(m *shipment.Message) { m.Headers["aggregate_id"] = "other"; m.Headers["aggregate_version"] = "x" },
		// Several SDKs send datacontenttype as a header too, beside the
		// content-type property: it was dead-lettered.
		"datacontenttype header too": func(m *shipment.Message) {
			m.Headers["cloudEvents_datacontenttype"] = "Application/JSON; charset=utf-8"
		},
	}
	for name, mut := range variants {
		m := message(p)
		m.Headers = maps.Clone(m.Headers)
		mut(&m)
		ev, err := shipment.Decode(m)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if shipment.MessageID(m) != p.MessageId || ev.Type != plain.Type || ev.OrderID != plain.OrderID || ev.Version != plain.Version ||
			ev.AggregateType != "order" || plain.AggregateType != "order" || ev.Created == nil || ev.Created.Total != plain.Created.Total {
			t.Errorf("%s: %+v, want %+v", name, ev, plain)
		}
	}
	m := message(p)
	if created, ok := shipment.CreatedAt(m.Headers); !ok || !created.Equal(e.CreatedAt) {
		t.Errorf("created at %v, %v; want %v to the microsecond", created, ok, e.CreatedAt)
	}
	// Only the attributes count: an outbox_created_at header beside them
	// is ignored.
	m.Headers = maps.Clone(m.Headers)
	m.Headers[shipment.HeaderCreatedAt] = "2000-01-01T00:00:00Z"
	if created, ok := shipment.CreatedAt(m.Headers); !ok || !created.Equal(e.CreatedAt) {
		t.Errorf("created at %v, %v beside an outbox_created_at header; want the time attribute, %v", created, ok, e.CreatedAt)
	}
}

// A message in the CloudEvents envelope that is no valid event, or that
// shipping cannot place, is dead-lettered with its reason.
func TestDecodeRefusesAnInvalidCloudEvent(t *testing.T) {
	ce := func(mut func(h map[string]any, m *shipment.Message)) shipment.Message {
		m := bindingExample("_")
		m.Headers["cloudEvents_type"] = shipment.TypeCreated
		m.Headers["cloudEvents_aggregateversion"] = int64(1)
		m.Body = []byte(createdBody)
		mut(m.Headers, &m)
		return m
	}
	if _, err := shipment.Decode(ce(func(map[string]any, *shipment.Message) {})); err != nil {
		t.Fatalf("the valid base: %v", err)
	}
	for name, tc := range map[string]struct {
		m    shipment.Message
		want shipment.Reason
	}{
		"no specversion":       {ce(func(h map[string]any, _ *shipment.Message) { delete(h, "cloudEvents_specversion") }), shipment.ReasonInvalidCloudEvent},
		"specversion 0.3":      {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_specversion"] = "0.3" }), shipment.ReasonInvalidCloudEvent},
		"no id":                {ce(func(h map[string]any, _ *shipment.Message) { delete(h, "cloudEvents_id") }), shipment.ReasonInvalidCloudEvent},
		"empty id":             {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_id"] = "" }), shipment.ReasonInvalidCloudEvent},
		"integer id":           {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_id"] = int64(7) }), shipment.ReasonInvalidCloudEvent},
		"no source":            {ce(func(h map[string]any, _ *shipment.Message) { delete(h, "cloudEvents_source") }), shipment.ReasonInvalidCloudEvent},
		"source not a URI":     {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_source"] = "/%zz" }), shipment.ReasonInvalidCloudEvent},
		"no type":              {ce(func(h map[string]any, _ *shipment.Message) { delete(h, "cloudEvents_type") }), shipment.ReasonInvalidCloudEvent},
		"empty subject":        {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_subject"] = "" }), shipment.ReasonInvalidCloudEvent},
		"bad time":             {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_time"] = "yesterday" }), shipment.ReasonInvalidCloudEvent},
		"mixed separators":     {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents:dataschema"] = "/s" }), shipment.ReasonInvalidCloudEvent},
		"upper-case attribute": {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_partitionKey"] = "k" }), shipment.ReasonInvalidCloudEvent},
		"datacontenttype header against the property": {ce(func(h map[string]any, m *shipment.Message) {
			m.ContentType = "application/json"
			h["cloudEvents_datacontenttype"] = "text/plain"
		}), shipment.ReasonInvalidCloudEvent},
		"datacontenttype header not text": {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_datacontenttype"] = int64(1) }),
			shipment.ReasonInvalidCloudEvent},
		"other MessageId":       {ce(func(_ map[string]any, m *shipment.Message) { m.MessageID = "other" }), shipment.ReasonInvalidCloudEvent},
		"no aggregateversion":   {ce(func(h map[string]any, _ *shipment.Message) { delete(h, "cloudEvents_aggregateversion") }), shipment.ReasonInvalidVersion},
		"aggregateversion text": {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_aggregateversion"] = "one" }), shipment.ReasonInvalidVersion},
		"aggregateversion 0":    {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_aggregateversion"] = int64(0) }), shipment.ReasonInvalidVersion},
		"aggregateversion 2^31": {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_aggregateversion"] = int64(1) << 31 }), shipment.ReasonInvalidVersion},
		"subject is not the order": {ce(func(h map[string]any, _ *shipment.Message) { h["cloudEvents_subject"] = "o-2" }),
			shipment.ReasonMalformedPayload},
	} {
		_, err := shipment.Decode(tc.m)
		var inv *shipment.InvalidError
		if !errors.As(err, &inv) || inv.Reason != tc.want {
			t.Errorf("%s: %v, want reason %s", name, err, tc.want)
			continue
		}
		if tc.want == shipment.ReasonInvalidCloudEvent {
			if _, _, ok := shipment.Locate(tc.m); ok {
				t.Errorf("%s: an invalid envelope located in an order", name)
			}
		}
		if strings.TrimSpace(err.Error()) == "" {
			t.Errorf("%s: no error text", name)
		}
	}
}

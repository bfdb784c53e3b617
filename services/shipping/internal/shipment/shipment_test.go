package shipment_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

const createdBody = `{"order_id":"o-1","customer_id":"c-42","currency":"EUR","items":[{"sku":"sku-1","quantity":2,"unit_price":1250}],"total":2500,"created_at":"2026-11-29T22:00:00Z"}`

func msg(mut func(*shipment.Message)) shipment.Message {
	m := shipment.Message{
		Type: shipment.TypeCreated, RoutingKey: shipment.TypeCreated,
		Headers: map[string]any{"aggregate_id": "o-1", "aggregate_version": int64(1)},
		Body:    []byte(createdBody),
	}
	if mut != nil {
		mut(&m)
	}
	return m
}

func TestDecodeValidEvents(t *testing.T) {
	ev, err := shipment.Decode(msg(nil))
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	if ev.OrderID != "o-1" || ev.Version != 1 || ev.Created == nil || ev.Created.Total != 2500 || len(ev.Created.Items) != 1 {
		t.Fatalf("got %+v", ev)
	}
	for name, m := range map[string]shipment.Message{
		"int32 version":            msg(func(m *shipment.Message) { m.Headers["aggregate_version"] = int32(1) }),
		"type from header":         msg(func(m *shipment.Message) { m.Type = "" }),
		"type from routing key":    msg(func(m *shipment.Message) { m.Type = ""; m.Headers["event_type"] = nil }),
		"unknown fields tolerated": msg(func(m *shipment.Message) { m.Body = []byte(strings.Replace(createdBody, `{`, `{"extra":1,`, 1)) }),
		"cancel": msg(func(m *shipment.Message) {
			m.Type, m.Headers["aggregate_version"], m.Body = shipment.TypeCancelled, int64(2), []byte(`{"order_id":"o-1","cancelled_at":"2026-11-29T22:01:00Z"}`)
		}),
	} {
		if _, err := shipment.Decode(m); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestDecodeRejectsPoisonWithItsReason(t *testing.T) {
	for name, tc := range map[string]struct {
		m    shipment.Message
		want shipment.Reason
	}{
		"no version":           {msg(func(m *shipment.Message) { delete(m.Headers, "aggregate_version") }), shipment.ReasonInvalidVersion},
		"string version":       {msg(func(m *shipment.Message) { m.Headers["aggregate_version"] = "1" }), shipment.ReasonInvalidVersion},
		"zero version":         {msg(func(m *shipment.Message) { m.Headers["aggregate_version"] = int64(0) }), shipment.ReasonInvalidVersion},
		"fractional version":   {msg(func(m *shipment.Message) { m.Headers["aggregate_version"] = 1.5 }), shipment.ReasonInvalidVersion},
		"create not version 1": {msg(func(m *shipment.Message) { m.Headers["aggregate_version"] = int64(2) }), shipment.ReasonInvalidVersion},
		"cancel at version 1": {msg(func(m *shipment.Message) {
			m.Type, m.Body = shipment.TypeCancelled, []byte(`{"order_id":"o-1"}`)
		}), shipment.ReasonInvalidVersion},
		"not json":      {msg(func(m *shipment.Message) { m.Body = []byte(`{"order_id":`) }), shipment.ReasonMalformedPayload},
		"trailing data": {msg(func(m *shipment.Message) { m.Body = []byte(createdBody + `{}`) }), shipment.ReasonMalformedPayload},
		"array body":    {msg(func(m *shipment.Message) { m.Body = []byte(`[]`) }), shipment.ReasonMalformedPayload},
		"no order id":   {msg(func(m *shipment.Message) { m.Body = []byte(`{"customer_id":"c","currency":"EUR"}`) }), shipment.ReasonMalformedPayload},
		"negative total": {msg(func(m *shipment.Message) {
			m.Body = []byte(strings.Replace(createdBody, `"total":2500`, `"total":-1`, 1))
		}), shipment.ReasonMalformedPayload},
		"header mismatch": {msg(func(m *shipment.Message) { m.Headers["aggregate_id"] = "o-2" }), shipment.ReasonMalformedPayload},
		"invalid utf8":    {msg(func(m *shipment.Message) { m.Body = []byte("{\"order_id\":\"\xff\"}") }), shipment.ReasonMalformedPayload},
		"oversized":       {msg(func(m *shipment.Message) { m.Body = make([]byte, shipment.MaxBodyBytes+1) }), shipment.ReasonPayloadTooLarge},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := shipment.Decode(tc.m)
			var inv *shipment.InvalidError
			if !errors.As(err, &inv) || inv.Reason != tc.want {
				t.Fatalf("Decode: %v, want reason %s", err, tc.want)
			}
		})
	}
}

func TestDecodeUnknownTypeIsANoOpAtItsVersion(t *testing.T) {
	ev, err := shipment.Decode(msg(func(m *shipment.Message) {
		m.Type, m.Headers["aggregate_version"], m.Body = "order.paid", int64(2), []byte(`{"anything":[1]}`)
	}))
	if err != nil || !ev.Ignored || ev.Type != "order.paid" || ev.OrderID != "o-1" || ev.Version != 2 {
		t.Fatalf("Decode: %+v, %v; want order.paid ignored at o-1 version 2", ev, err)
	}
	// Without the aggregate_id header, the payload's order_id places it.
	ev, err = shipment.Decode(msg(func(m *shipment.Message) {
		m.Type, m.Body = "order.paid", []byte(`{"order_id":"o-9"}`)
		delete(m.Headers, "aggregate_id")
	}))
	if err != nil || !ev.Ignored || ev.OrderID != "o-9" {
		t.Fatalf("Decode without aggregate_id: %+v, %v", ev, err)
	}
	for name, tc := range map[string]struct {
		m    shipment.Message
		want shipment.Reason
	}{
		"no order": {msg(func(m *shipment.Message) {
			m.Type, m.Body = "order.paid", []byte(`{}`)
			delete(m.Headers, "aggregate_id")
		}), shipment.ReasonMalformedPayload},
		"no version": {msg(func(m *shipment.Message) {
			m.Type = "order.paid"
			delete(m.Headers, "aggregate_version")
		}), shipment.ReasonInvalidVersion},
	} {
		var inv *shipment.InvalidError
		if _, err := shipment.Decode(tc.m); !errors.As(err, &inv) || inv.Reason != tc.want {
			t.Errorf("%s: %v, want reason %s", name, err, tc.want)
		}
	}
}

func TestBuild(t *testing.T) {
	if _, err := shipment.Build("o", nil); !errors.Is(err, shipment.ErrNotFound) {
		t.Fatalf("no records: %v", err)
	}
	s, err := shipment.Build("o", []shipment.Record{
		{Applied: shipment.Applied{MessageID: "1", EventType: shipment.TypeCreated, Version: 1}, Created: &shipment.Created{Currency: "EUR", Total: 5}},
		{Applied: shipment.Applied{MessageID: "2", EventType: shipment.TypeCancelled, Version: 2}},
	})
	if err != nil || s.Status != shipment.StatusCancelled || s.Version != 2 || len(s.Events) != 2 || s.Total != 5 {
		t.Fatalf("Build: %+v, %v", s, err)
	}
	s, err = shipment.Build("o", []shipment.Record{
		{Applied: shipment.Applied{MessageID: "1", EventType: shipment.TypeCreated, Version: 1}, Created: &shipment.Created{Currency: "EUR", Total: 5}},
		{Applied: shipment.Applied{MessageID: "2", EventType: "order.paid", Version: 2}},
		{Applied: shipment.Applied{MessageID: "3", EventType: shipment.TypeCancelled, Version: 3}},
	})
	if err != nil || s.Status != shipment.StatusCancelled || s.Version != 3 || len(s.Events) != 3 {
		t.Fatalf("Build with an ignored type: %+v, %v", s, err)
	}
	if _, err := shipment.Build("o", []shipment.Record{{Applied: shipment.Applied{MessageID: "1", EventType: "order.drafted", Version: 1}}}); !errors.Is(err, shipment.ErrNotFound) {
		t.Fatalf("a chain without order.created: %v, want ErrNotFound", err)
	}
	if _, err := shipment.Build("o", []shipment.Record{{Applied: shipment.Applied{Version: 2}}}); err == nil {
		t.Fatal("Build accepted a chain starting at version 2")
	}
}

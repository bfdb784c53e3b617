package outboxamqp_test

import (
	"fmt"
	"log"
	"maps"
	"slices"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// The message a Publisher with Config.CloudEvents sends for an envelope: a
// CloudEvents 1.0 event in the AMQP binding's binary content mode.
func ExampleCloudEventsPublishing() {
	e := outbox.Envelope{
		ID: 42, AggregateType: "order", AggregateID: "o-1", AggregateVersion: 2, EventType: "order.cancelled",
		Payload:   []byte(`{"order_id":"o-1"}`),
		Headers:   map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		CreatedAt: time.Date(2026, 11, 29, 22, 1, 0, 500000000, time.UTC),
	}
	m, err := outboxamqp.CloudEventsPublishing(e, outboxamqp.CloudEvents{Source: "/orders"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("content-type:", m.ContentType)
	for _, k := range slices.Sorted(maps.Keys(m.Headers)) {
		fmt.Printf("%s: %v\n", k, m.Headers[k])
	}
	fmt.Printf("body: %s\n", m.Body)
	// Output:
	// content-type: application/json
	// cloudEvents_aggregatetype: order
	// cloudEvents_aggregateversion: 2
	// cloudEvents_id: 42-1795989660500000
	// cloudEvents_source: /orders
	// cloudEvents_specversion: 1.0
	// cloudEvents_subject: o-1
	// cloudEvents_time: 2026-11-29T22:01:00.5Z
	// cloudEvents_traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01
	// cloudEvents_type: order.cancelled
	// traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01
	// body: {"order_id":"o-1"}
}

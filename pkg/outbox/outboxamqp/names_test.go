package outboxamqp_test

import (
	"testing"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// Exchange and RoutingKey name where PublishBatch sends an envelope, for
// instrumentation that describes the publish.
func TestExchangeAndRoutingKey(t *testing.T) {
	t.Parallel()
	e := outbox.Envelope{ID: 7, AggregateType: "order", EventType: "order.created"}
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: "amqp://guest:guest@127.0.0.1:1/", Exchange: "orders.events"})
	if err != nil {
		t.Fatal(err)
	}
	if p.Exchange() != "orders.events" || p.RoutingKey(e) != "order.created" {
		t.Fatalf("default: exchange %q, routing key %q", p.Exchange(), p.RoutingKey(e))
	}
	p, err = outboxamqp.NewPublisher(outboxamqp.Config{
		URL: "amqp://guest:guest@127.0.0.1:1/", Exchange: "x",
		RoutingKey: func(e outbox.Envelope) string { return e.AggregateType + "." + e.EventType },
	})
	if err != nil {
		t.Fatal(err)
	}
	if p.RoutingKey(e) != "order.order.created" {
		t.Fatalf("configured routing key: %q", p.RoutingKey(e))
	}
}

package rabbitmq_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// The operator's request is linked to a replay, never copied into it: a
// kept message without baggage goes out without the baggage the operator's
// client sent to the admin endpoint.
func TestReplayDoesNotCarryTheOperatorsBaggage(t *testing.T) {
	t.Parallel()
	url, ch := amqptest.Queue(t, "q")
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	pub := &rabbitmq.ReplayPublisher{URL: url, Queue: "q", TracerProvider: tp, Propagator: tracing.Propagator()}
	t.Cleanup(func() { _ = pub.Close() })

	member, err := baggage.NewMember("operator", "alice")
	if err != nil {
		t.Fatal(err)
	}
	bag, err := baggage.New(member)
	if err != nil {
		t.Fatal(err)
	}
	ctx, operator := tp.Tracer("test").Start(baggage.ContextWithBaggage(t.Context(), bag), "operator request")
	err = pub.Publish(ctx, shipment.KeptMessage{
		MessageID: "m-1", RoutingKey: "order.created", Body: []byte("{}"),
		Headers: map[string]any{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
	})
	operator.End()
	if err != nil {
		t.Fatal(err)
	}
	d := amqptest.GetOne(t, ch, "q") // the replayed message
	if b, ok := d.Headers["baggage"]; ok {
		t.Fatalf("replayed message carries baggage %q, which only the operator's request had", b)
	}
}

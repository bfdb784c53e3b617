package rabbitmq_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// A replayed dead letter stays in the trace kept with it: its publish span
// is a child of the kept context, linked to the operator's span, and the
// message goes out with the publish span's context and the kept baggage.
func TestReplayedMessageStaysInTheTraceKeptWithIt(t *testing.T) {
	t.Parallel()
	url, ch := amqptest.Queue(t, "q")

	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	const kept = "4bf92f3577b34da6a3ce929d0e0e4736"
	pub := &rabbitmq.ReplayPublisher{URL: url, Queue: "q", TracerProvider: tp, Propagator: tracing.Propagator()}
	t.Cleanup(func() { _ = pub.Close() })
	ctx, operator := tp.Tracer("test").Start(t.Context(), "operator request")
	err := pub.Publish(ctx, shipment.KeptMessage{
		MessageID: "m-1", RoutingKey: "order.created", Body: []byte("{}"),
		Headers: map[string]any{"traceparent": "00-" + kept + "-00f067aa0ba902b7-01", "baggage": "tenant=acme", "aggregate_id": "o-1"},
	})
	operator.End()
	if err != nil {
		t.Fatal(err)
	}

	d := amqptest.GetOne(t, ch, "q") // the replayed message
	var span sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "publish q" {
			span = s
		}
	}
	if span == nil {
		t.Fatal("no publish span")
	}
	if span.SpanKind() != trace.SpanKindProducer || span.SpanContext().TraceID().String() != kept || span.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("publish span %v kind %v under %v: want a producer under the kept context", span.SpanContext(), span.SpanKind(), span.Parent())
	}
	if links := span.Links(); len(links) != 1 || links[0].SpanContext.SpanID() != operator.SpanContext().SpanID() {
		t.Fatalf("publish span links %v, want the operator's span", links)
	}
	tpHeader, _ := d.Headers["traceparent"].(string)
	if want := "00-" + kept + "-" + span.SpanContext().SpanID().String() + "-01"; tpHeader != want {
		t.Fatalf("replayed traceparent %q, want %q", tpHeader, want)
	}
	if b, _ := d.Headers["baggage"].(string); !strings.Contains(b, "tenant=acme") {
		t.Fatalf("replayed baggage %q", b)
	}
	if d.Headers["aggregate_id"] != "o-1" {
		t.Fatalf("other headers lost: %v", d.Headers)
	}
}

// A replay the broker returns (its queue is gone) ends its publish span as
// an error with error.type.
func TestFailedReplayPublishSpanCarriesErrorType(t *testing.T) {
	t.Parallel()
	url, _ := amqptest.Queue(t, "q")
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	pub := &rabbitmq.ReplayPublisher{URL: url, Queue: "no-such-queue", TracerProvider: tp, Propagator: tracing.Propagator()}
	t.Cleanup(func() { _ = pub.Close() })
	if err := pub.Publish(t.Context(), shipment.KeptMessage{MessageID: "m-1", Body: []byte("{}")}); !errors.Is(err, rabbitmq.ErrReturned) {
		t.Fatalf("replay to a missing queue: %v, want it returned", err)
	}
	var span sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "publish no-such-queue" {
			span = s
		}
	}
	if span == nil {
		t.Fatal("no publish span")
	}
	var errType string
	for _, kv := range span.Attributes() {
		if kv.Key == "error.type" {
			errType = kv.Value.AsString()
		}
	}
	if span.Status().Code != codes.Error || errType != rabbitmq.ErrorTypeUnroutable {
		t.Fatalf("publish span status %v, error.type %q: want an error, %q", span.Status(), errType, rabbitmq.ErrorTypeUnroutable)
	}
}

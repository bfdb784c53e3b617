package outboxotel_test

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxotel"
)

// printingPublisher stands in for outboxamqp.Publisher: it names its exchange
// and routing keys, and prints the headers it would send.
type printingPublisher struct{}

func (printingPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }
func (printingPublisher) Exchange() string                    { return "orders.events" }
func (printingPublisher) RoutingKey(e outbox.Envelope) string { return e.EventType }

func (printingPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	for _, m := range msgs {
		fmt.Printf("sent %d with baggage %q\n", m.ID, m.Headers["baggage"])
	}
	return make([]error, len(msgs))
}

// The writer stores its span's context with the event; the relay's publish
// span continues that trace and its context is what goes to the broker.
func Example() {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

	// Write side, in the request: an incoming context with baggage, a span
	// around the write, its context stored with the event.
	ctx := prop.Extract(context.Background(), propagation.MapCarrier{
		"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"baggage":     "tenant=acme",
	})
	ctx, write := tp.Tracer("orders").Start(ctx, "orders.create")
	headers := outboxotel.InjectHeaders(ctx, prop, nil)
	write.End()

	// Relay side: the row as claimed, published through the decorator.
	pub := outboxotel.NewPublisher(printingPublisher{}, outboxotel.Config{TracerProvider: tp, Propagator: prop})
	pub.PublishBatch(context.Background(), []outbox.Envelope{{
		ID: 7, AggregateType: "order", AggregateID: "o-1", AggregateVersion: 1,
		EventType: "order.created", Payload: []byte(`{}`), Headers: headers, Attempt: 1,
	}})

	for _, s := range exp.GetSpans() {
		fmt.Printf("%s (%s) in trace %s…, parent %s\n", s.Name, s.SpanKind, s.SpanContext.TraceID().String()[:8],
			map[bool]string{true: "orders.create", false: "the client's span"}[s.Parent.SpanID() == write.SpanContext().SpanID()])
	}
	fmt.Println("stored with the event:", slices.Sorted(maps.Keys(headers)))
	// Output:
	// sent 7 with baggage "tenant=acme"
	// orders.create (internal) in trace 4bf92f35…, parent the client's span
	// publish orders.events (producer) in trace 4bf92f35…, parent orders.create
	// stored with the event: [baggage traceparent]
}

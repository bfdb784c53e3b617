package outboxotel_test

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

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

// The writer stores its create span's context, with the baggage it allows,
// with the event; the relay's publish span is that span's child (the event
// is young) and links to it, and the message goes out with the stored
// headers, for the consumer to link to.
func Example() {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	tracer := tp.Tracer("orders")

	// Write side, in the request: an incoming context with baggage, a span
	// around the write, a create span for the event, whose context is
	// stored with it, with the tenant's baggage only.
	ctx := prop.Extract(context.Background(), propagation.MapCarrier{
		"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"baggage":     "tenant=acme,session=s-91",
	})
	ctx, write := tracer.Start(ctx, "orders.create")
	cctx, create := tracer.Start(ctx, "create orders.events", trace.WithSpanKind(trace.SpanKindProducer))
	headers := outboxotel.InjectHeaders(outboxotel.LimitBaggage(cctx, []string{"tenant"}, 512), prop, nil)
	create.End()
	write.End()

	// Relay side: the row as claimed, published through the decorator.
	pub := outboxotel.NewPublisher(printingPublisher{}, outboxotel.Config{TracerProvider: tp, Propagator: prop})
	pub.PublishBatch(context.Background(), []outbox.Envelope{{
		ID: 7, AggregateType: "order", AggregateID: "o-1", AggregateVersion: 1,
		EventType: "order.created", Payload: []byte(`{}`), Headers: headers, Attempt: 1, CreatedAt: time.Now(),
	}})

	names := map[trace.SpanID]string{write.SpanContext().SpanID(): "orders.create", create.SpanContext().SpanID(): "create orders.events"}
	for _, s := range exp.GetSpans() {
		parent := cmp.Or(names[s.Parent.SpanID()], "the client's span")
		linked := ""
		for _, l := range s.Links {
			linked = ", linked to " + names[l.SpanContext.SpanID()]
		}
		fmt.Printf("%s (%s) in trace %s…, parent %s%s\n", s.Name, s.SpanKind, s.SpanContext.TraceID().String()[:8], parent, linked)
	}
	fmt.Println("stored with the event:", slices.Sorted(maps.Keys(headers)))
	// Output:
	// sent 7 with baggage "tenant=acme"
	// create orders.events (producer) in trace 4bf92f35…, parent orders.create
	// orders.create (internal) in trace 4bf92f35…, parent the client's span
	// publish orders.events (client) in trace 4bf92f35…, parent create orders.events, linked to create orders.events
	// stored with the event: [baggage traceparent]
}

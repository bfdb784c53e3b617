package main

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxotel"
)

// The services trace with OpenTelemetry, and with no exporter configured they
// run the same code with a no-op provider. The figures measure that path, so
// "tracing off costs nothing measurable" is part of what they compare.

// benchPropagator is the services' propagator: W3C Trace Context and Baggage.
func benchPropagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// untraced wraps a relay's publisher in the tracing decorator the orders
// service uses, with tracing off.
func untraced(pub outbox.Publisher) outbox.Publisher {
	return outboxotel.NewPublisher(pub, outboxotel.Config{Propagator: benchPropagator()})
}

// untracedWriteHeaders is what the orders store does for an event with
// tracing off: the client's context is extracted (a random sampled
// traceparent, as a client would send), the write span and the event's
// create span are started on a no-op tracer, and the event's headers are
// written from the create span's context with the allowed baggage.
func untracedWriteHeaders(ctx context.Context) map[string]string {
	prop := benchPropagator()
	tracer := noop.NewTracerProvider().Tracer("bench")
	ctx = prop.Extract(ctx, propagation.MapCarrier(traceHeaders()))
	ctx, span := tracer.Start(ctx, "orders.create")
	defer span.End()
	ctx, create := tracer.Start(ctx, "create orders.events")
	defer create.End()
	return outboxotel.InjectHeaders(outboxotel.LimitBaggage(ctx, nil, 512), prop, nil)
}

// Package outboxotel traces the outbox with OpenTelemetry: a Publisher
// decorator that gives every publish a producer span in the trace of the
// request that wrote the event, and InjectHeaders, which writers use to store
// that request's trace context with the event.
//
// It uses the OpenTelemetry API only (trace, propagation, attribute, codes,
// semconv): the application chooses and configures the SDK and hands over its
// TracerProvider and propagator. Package outbox itself does not depend on
// OpenTelemetry: it stores and carries headers, nothing more.
//
// # The trace across the outbox
//
// A writer stores the W3C trace context (traceparent, tracestate) and baggage
// of its current span in the event's headers, in the business transaction:
//
//	ctx, span := tracer.Start(ctx, "orders.create")
//	defer span.End()
//	headers := outboxotel.InjectHeaders(ctx, propagator, nil)
//	_, err := writer.Enqueue(ctx, tx, outbox.Message{..., Headers: headers})
//
// The relay publishes through the decorator:
//
//	amqpPub, _ := outboxamqp.New(...)
//	pub := outboxotel.NewPublisher(amqpPub, outboxotel.Config{
//		TracerProvider: tp, Propagator: propagator,
//	})
//	relay, _ := outbox.NewRelay(pool, pub, outbox.RelayConfig{...})
//
// For each envelope it extracts the stored context, starts a span of kind
// PRODUCER as its child, named "publish <exchange>" with the messaging
// semantic conventions' attributes, and hands the inner publisher a copy of
// the envelope whose traceparent, tracestate and baggage are those of the
// publish span. A consumer that extracts them continues the same trace, with
// the publish span as its parent. The stored row is never changed, so every
// attempt (a retry after a failure, a publish again after a lost confirm)
// starts from the writer's context: all of them belong to the original trace,
// each with its own publish span (outbox.attempt tells them apart).
//
// An unsampled context stays unsampled: the span is not recorded, but its
// context, with the sampled flag cleared, the trace id and the baggage, is
// still injected. With a no-op TracerProvider (tracing off) the decorator
// passes the batch through untouched, allocating nothing: the stored headers
// are already what a no-op span would inject.
package outboxotel

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// ScopeName is the instrumentation scope of the spans this package starts.
const ScopeName = "github.com/outbox-inbox/reference/pkg/outbox/outboxotel"

// The outbox's own span attributes, beside the messaging ones.
const (
	AttrAggregateType    = attribute.Key("outbox.aggregate.type")
	AttrAggregateID      = attribute.Key("outbox.aggregate.id")
	AttrAggregateVersion = attribute.Key("outbox.aggregate.version")
	AttrEventType        = attribute.Key("outbox.event.type")
	AttrAttempt          = attribute.Key("outbox.attempt")
)

// The header names the propagator writes: W3C Trace Context and Baggage.
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
	HeaderBaggage     = "baggage"
)

// Destinations is what a publisher that knows its routing can tell the
// decorator; outboxamqp.Publisher implements it.
type Destinations interface {
	// Exchange is the messaging.destination.name of every publish.
	Exchange() string
	// RoutingKey is an envelope's messaging.rabbitmq.destination.routing_key.
	RoutingKey(outbox.Envelope) string
}

// Config configures a Publisher. The zero value of every field means its
// default.
type Config struct {
	// TracerProvider starts the publish spans. Default: a no-op provider.
	TracerProvider trace.TracerProvider
	// Propagator reads the stored context and writes the publish span's.
	// Default: W3C Trace Context and Baggage.
	Propagator propagation.TextMapPropagator
	// System is messaging.system. Default "rabbitmq".
	System string
	// Destination returns an envelope's messaging.destination.name (for
	// RabbitMQ, the exchange). Default: the inner publisher's Exchange when it
	// implements Destinations, else none (the span is then named "publish").
	Destination func(outbox.Envelope) string
	// RoutingKey returns an envelope's routing key, recorded as
	// messaging.rabbitmq.destination.routing_key. Default: the inner
	// publisher's RoutingKey when it implements Destinations, else none.
	RoutingKey func(outbox.Envelope) string
}

// Publisher decorates an outbox.Publisher with a producer span per envelope
// and the span's context in the headers that go out. It keeps the inner
// publisher's contract: one error per envelope, in order, unchanged.
type Publisher struct {
	inner       outbox.Publisher
	tracer      trace.Tracer
	prop        propagation.TextMapPropagator
	system      attribute.KeyValue
	destination func(outbox.Envelope) string
	routingKey  func(outbox.Envelope) string
	off         bool
}

var _ outbox.Publisher = (*Publisher)(nil)

// NewPublisher returns inner decorated with tracing as cfg says.
func NewPublisher(inner outbox.Publisher, cfg Config) *Publisher {
	tp := cfg.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	_, off := tp.(noop.TracerProvider)
	prop := cfg.Propagator
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	p := &Publisher{
		inner:       inner,
		tracer:      tp.Tracer(ScopeName),
		prop:        prop,
		system:      semconv.MessagingSystemRabbitMQ,
		destination: cfg.Destination,
		routingKey:  cfg.RoutingKey,
		off:         off,
	}
	if cfg.System != "" {
		p.system = semconv.MessagingSystemKey.String(cfg.System)
	}
	if d, ok := inner.(Destinations); ok {
		if p.destination == nil {
			p.destination = func(outbox.Envelope) string { return d.Exchange() }
		}
		if p.routingKey == nil {
			p.routingKey = d.RoutingKey
		}
	}
	return p
}

// WaitReady is the inner publisher's.
func (p *Publisher) WaitReady(ctx context.Context) error { return p.inner.WaitReady(ctx) }

// PublishBatch starts a producer span per envelope, a child of the context
// stored in its headers, publishes copies of the envelopes carrying the spans'
// contexts, and ends each span with its envelope's outcome.
func (p *Publisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	if p.off || len(msgs) == 0 {
		return p.inner.PublishBatch(ctx, msgs)
	}
	out := make([]outbox.Envelope, len(msgs))
	spans := make([]trace.Span, len(msgs))
	for i, m := range msgs {
		_, span, headers := p.start(ctx, m)
		spans[i] = span
		out[i] = m
		out[i].Headers = headers
	}
	errs := p.inner.PublishBatch(ctx, out)
	for i, span := range spans {
		if i < len(errs) && errs[i] != nil {
			span.RecordError(errs[i])
			span.SetStatus(codes.Error, errs[i].Error())
		}
		span.End()
	}
	return errs
}

// start starts m's publish span and returns it with the headers to send: a
// copy of m's headers with the span's trace context and baggage.
func (p *Publisher) start(ctx context.Context, m outbox.Envelope) (context.Context, trace.Span, map[string]string) {
	// The event's context is what was stored with it, and nothing else: a
	// span or baggage on the relay's own context must not leak into it.
	parent := p.prop.Extract(eventBase(ctx), propagation.MapCarrier(m.Headers))
	dest, name := "", "publish"
	if p.destination != nil {
		if dest = p.destination(m); dest != "" {
			name = "publish " + dest
		}
	}
	attrs := make([]attribute.KeyValue, 0, 13)
	attrs = append(attrs,
		p.system,
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("publish"),
		semconv.MessagingDestinationName(dest),
		semconv.MessagingMessageID(strconv.FormatInt(m.ID, 10)),
		semconv.MessagingMessageBodySize(len(m.Payload)),
	)
	if p.routingKey != nil {
		attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(p.routingKey(m)))
	}
	attrs = append(attrs,
		AttrAggregateType.String(m.AggregateType),
		AttrAggregateID.String(m.AggregateID),
		AttrAggregateVersion.Int64(m.AggregateVersion),
		AttrEventType.String(m.EventType),
		AttrAttempt.Int(m.Attempt),
	)
	ctx, span := p.tracer.Start(parent, name,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attrs...),
	)
	headers := make(map[string]string, len(m.Headers)+3)
	for k, v := range m.Headers {
		headers[k] = v
	}
	// Replace, never merge: what the publish span's context lacks (an empty
	// tracestate, no baggage) must not survive from the stored headers.
	delete(headers, HeaderTraceparent)
	delete(headers, HeaderTracestate)
	delete(headers, HeaderBaggage)
	p.prop.Inject(ctx, propagation.MapCarrier(headers))
	return ctx, span, headers
}

// eventBase is ctx without its span and baggage: the base on which an
// event's stored context is read.
func eventBase(ctx context.Context) context.Context {
	return baggage.ContextWithoutBaggage(trace.ContextWithSpanContext(ctx, trace.SpanContext{}))
}

// InjectHeaders writes the trace context and baggage of ctx into headers
// with propagator (W3C Trace Context and Baggage when nil) and returns
// headers, allocated when nil and something is written. A writer calls it in
// the span that writes the event, so the event carries that span's context.
// When ctx carries no valid span context and no baggage, nothing is written:
// no trace is invented.
func InjectHeaders(ctx context.Context, propagator propagation.TextMapPropagator, headers map[string]string) map[string]string {
	if propagator == nil {
		propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	if headers == nil {
		c := make(propagation.MapCarrier, 3)
		propagator.Inject(ctx, c)
		if len(c) == 0 {
			return nil
		}
		return c
	}
	propagator.Inject(ctx, propagation.MapCarrier(headers))
	return headers
}

// Extract returns ctx with the trace context and baggage stored in headers,
// read with propagator (W3C Trace Context and Baggage when nil): what a
// consumer or a tool that replays an event continues from.
func Extract(ctx context.Context, propagator propagation.TextMapPropagator, headers map[string]string) context.Context {
	if propagator == nil {
		propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	return propagator.Extract(ctx, propagation.MapCarrier(headers))
}

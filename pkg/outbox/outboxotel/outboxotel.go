// Package outboxotel traces the outbox with OpenTelemetry, as the messaging
// semantic conventions lay out a message's life: the writer's PRODUCER
// "create" span, whose context is stored with the event (InjectHeaders),
// and a Publisher decorator that gives every publish a PRODUCER "publish"
// span linked to that creation context.
//
// It uses the OpenTelemetry API only (trace, propagation, baggage,
// attribute, codes, semconv): the application chooses and configures the SDK
// and hands over its TracerProvider and propagator. Package outbox itself
// does not depend on OpenTelemetry: it stores and carries headers, nothing
// more.
//
// # The write side
//
// A writer starts a PRODUCER span named "create <destination>" for each
// event, in the transaction that writes it, stores that span's context
// (W3C traceparent, tracestate) with the event, with the baggage it allows
// (LimitBaggage), and records the message id the event is sent under:
//
//	ctx, create := tracer.Start(ctx, "create orders.events", trace.WithSpanKind(trace.SpanKindProducer),
//		trace.WithAttributes(semconv.MessagingOperationTypeCreate, ...))
//	headers := outboxotel.InjectHeaders(outboxotel.LimitBaggage(ctx, []string{"tenant"}, 512), propagator, nil)
//	enqueued, err := writer.Enqueue(ctx, tx, outbox.Message{..., Headers: headers})
//	if err == nil {
//		create.SetAttributes(semconv.MessagingMessageID(enqueued[0].MessageID()))
//	}
//	create.End()
//
// That creation context travels with the message unchanged: the relay sends
// the stored headers as they are, and a consumer links its process span to
// them.
//
// # The relay side
//
// The relay publishes through the decorator:
//
//	amqpPub, _ := outboxamqp.NewPublisher(...)
//	pub := outboxotel.NewPublisher(amqpPub, outboxotel.Config{
//		TracerProvider: tp, Propagator: propagator,
//	})
//	relay, _ := outbox.NewRelay(pool, pub, outbox.RelayConfig{...})
//
// For each envelope it reads the stored creation context and starts a span
// named "publish <exchange>", with the messaging semantic conventions'
// attributes (and server.address and server.port when the
// inner publisher names the node it is connected to), linked to the
// creation context. As the conventions say, it is of kind CLIENT, the
// create span being the message's PRODUCER span; an event stored without a
// creation context gets a PRODUCER publish span, the root of a trace. The span is that context's child when the event is
// younger than Config.ParentMaxAge (30 seconds by default), so the usual
// order, written and published within milliseconds, is one trace; an event
// that waited longer (a broker outage, a relay down for an hour) is
// published in a trace of its own, linked to its creation, rather than
// stretching one trace over the whole wait, which tail samplers split or
// drop. Each attempt has its own span (outbox.attempt tells them apart), and
// a failed one records the error with error.type.
//
// When the inner publisher reports each message's confirm time
// (ConfirmTimer; outboxamqp.Publisher does), each span ends at its own
// message's confirm, not at the end of the batch.
//
// An unsampled creation context stays unsampled: no publish span is
// started for it at all. With a no-op TracerProvider (tracing off) the
// decorator passes the batch through untouched, allocating nothing.
package outboxotel

import (
	"context"
	"errors"
	"time"

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

// The header names the default propagator writes: W3C Trace Context and
// Baggage.
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
	HeaderBaggage     = "baggage"
)

// DefaultParentMaxAge is Config.ParentMaxAge's default.
const DefaultParentMaxAge = 30 * time.Second

// The error.type values of failed publish spans.
const (
	ErrorTypeUnroutable = "unroutable" // outbox.ErrUnroutable
	ErrorTypeNotSent    = "not_sent"   // outbox.ErrNotSent
	ErrorTypeTimeout    = "timeout"    // a context deadline
	ErrorTypeOther      = "_OTHER"     // the semantic conventions' fallback
)

// Destinations is what a publisher that knows its routing can tell the
// decorator; outboxamqp.Publisher implements it.
type Destinations interface {
	// Exchange is the messaging.destination.name of every publish.
	Exchange() string
	// RoutingKey is an envelope's messaging.rabbitmq.destination.routing_key.
	RoutingKey(outbox.Envelope) string
}

// Server is what a publisher that knows where it is connected can tell the
// decorator, for server.address and server.port; outboxamqp.Publisher
// implements it. An empty host means not connected.
type Server interface {
	Node() (host string, port int)
}

// ConfirmTimer is a publisher that reports when each message's confirm
// arrived (outboxamqp.Publisher): PublishBatchTimed is PublishBatch that also
// sets confirmed[i] to the time message i's confirm, positive or not, was
// seen, and leaves it zero when none was. The decorator ends each publish
// span then.
type ConfirmTimer interface {
	PublishBatchTimed(ctx context.Context, msgs []outbox.Envelope, confirmed []time.Time) []error
}

// Config configures a Publisher. The zero value of every field means its
// default.
type Config struct {
	// TracerProvider starts the publish spans. Default: a no-op provider.
	TracerProvider trace.TracerProvider
	// Propagator reads the stored creation context. Default: W3C Trace
	// Context and Baggage.
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
	// ParentMaxAge is how old an event may be for its publish span to be a
	// child of its creation context (linked to it either way); an older one
	// is published in a trace of its own. Default: DefaultParentMaxAge
	// (30s); negative: never a child, always a trace of its own.
	ParentMaxAge time.Duration
	// Now is the clock the age is measured with. Default: time.Now.
	Now func() time.Time
}

// Publisher decorates an outbox.Publisher with a producer span per envelope.
// It keeps the inner publisher's contract: the envelopes go out unchanged,
// with one error per envelope, in order, unchanged.
type Publisher struct {
	inner        outbox.Publisher
	timer        ConfirmTimer
	server       Server
	tracer       trace.Tracer
	prop         propagation.TextMapPropagator
	system       attribute.KeyValue
	destination  func(outbox.Envelope) string
	routingKey   func(outbox.Envelope) string
	parentMaxAge time.Duration
	now          func() time.Time
	off          bool
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
		inner:        inner,
		tracer:       tp.Tracer(ScopeName),
		prop:         prop,
		system:       semconv.MessagingSystemRabbitMQ,
		destination:  cfg.Destination,
		routingKey:   cfg.RoutingKey,
		parentMaxAge: cfg.ParentMaxAge,
		now:          cfg.Now,
		off:          off,
	}
	if p.parentMaxAge == 0 {
		p.parentMaxAge = DefaultParentMaxAge
	}
	if p.now == nil {
		p.now = time.Now
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
	p.timer, _ = inner.(ConfirmTimer)
	p.server, _ = inner.(Server)
	return p
}

// WaitReady is the inner publisher's.
func (p *Publisher) WaitReady(ctx context.Context) error { return p.inner.WaitReady(ctx) }

// PublishBatch starts a producer span per envelope, linked to (and maybe a
// child of) the creation context stored in its headers, publishes the
// envelopes unchanged, and ends each span with its envelope's outcome, at
// its confirm when the inner publisher reports it.
func (p *Publisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	if p.off || len(msgs) == 0 {
		return p.inner.PublishBatch(ctx, msgs)
	}
	spans := make([]trace.Span, len(msgs))
	recording := false
	now := p.now()
	var server []attribute.KeyValue
	if p.server != nil {
		if host, port := p.server.Node(); host != "" {
			server = []attribute.KeyValue{semconv.ServerAddress(host), semconv.ServerPort(port)}
		}
	}
	for i, m := range msgs {
		spans[i] = p.start(ctx, m, now, server)
		recording = recording || spans[i] != nil
	}
	var errs []error
	var confirmed []time.Time
	if p.timer != nil && recording {
		confirmed = make([]time.Time, len(msgs))
		errs = p.timer.PublishBatchTimed(ctx, msgs, confirmed)
	} else {
		errs = p.inner.PublishBatch(ctx, msgs)
	}
	end := time.Now()
	for i, span := range spans {
		if span == nil {
			continue
		}
		if i < len(errs) && errs[i] != nil {
			span.RecordError(errs[i])
			span.SetStatus(codes.Error, errs[i].Error())
			span.SetAttributes(semconv.ErrorTypeKey.String(ErrorType(errs[i])))
		}
		at := end
		if confirmed != nil && !confirmed[i].IsZero() {
			at = confirmed[i]
		}
		span.End(trace.WithTimestamp(at))
	}
	return errs
}

// ErrorType is a publish error's error.type: a low-cardinality class, not
// the message.
func ErrorType(err error) string {
	switch {
	case errors.Is(err, outbox.ErrUnroutable):
		return ErrorTypeUnroutable
	case errors.Is(err, outbox.ErrNotSent):
		return ErrorTypeNotSent
	case errors.Is(err, context.DeadlineExceeded):
		return ErrorTypeTimeout
	default:
		return ErrorTypeOther
	}
}

// start starts m's publish span, or returns nil when nothing is to be
// recorded (an unsampled creation context, or a root the sampler dropped).
func (p *Publisher) start(ctx context.Context, m outbox.Envelope, now time.Time, server []attribute.KeyValue) trace.Span {
	// The event's context is what was stored with it, and nothing else: a
	// span or baggage on the relay's own context must not leak into it.
	base := eventBase(ctx)
	creation := trace.SpanContextFromContext(p.prop.Extract(base, propagation.MapCarrier(m.Headers)))
	if creation.IsValid() && !creation.IsSampled() {
		return nil
	}
	dest, name := "", "publish"
	if p.destination != nil {
		if dest = p.destination(m); dest != "" {
			name = "publish " + dest
		}
	}
	attrs := make([]attribute.KeyValue, 0, 15)
	attrs = append(attrs,
		p.system,
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("publish"),
		semconv.MessagingDestinationName(dest),
		semconv.MessagingMessageID(m.MessageID()),
		semconv.MessagingMessageBodySize(len(m.Payload)),
	)
	if p.routingKey != nil {
		attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(p.routingKey(m)))
	}
	attrs = append(attrs, server...)
	attrs = append(attrs,
		AttrAggregateType.String(m.AggregateType),
		AttrAggregateID.String(m.AggregateID),
		AttrAggregateVersion.Int64(m.AggregateVersion),
		AttrEventType.String(m.EventType),
		AttrAttempt.Int(m.Attempt),
	)
	// The messaging conventions: a send span is PRODUCER when it is the
	// message's creation context, CLIENT when a create span is. The stored
	// context is the creation context; without one, the publish is the
	// message's only span.
	kind := trace.SpanKindProducer
	if creation.IsValid() {
		kind = trace.SpanKindClient
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(kind), trace.WithAttributes(attrs...)}
	parent := base
	if creation.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: creation}))
		if p.parentMaxAge > 0 && now.Sub(m.CreatedAt) <= p.parentMaxAge {
			parent = trace.ContextWithRemoteSpanContext(base, creation)
		} else {
			opts = append(opts, trace.WithNewRoot())
		}
	}
	_, span := p.tracer.Start(parent, name, opts...)
	if !span.IsRecording() {
		return nil
	}
	return span
}

// eventBase is ctx without its span and baggage: the base on which an
// event's stored context is read.
func eventBase(ctx context.Context) context.Context {
	return baggage.ContextWithoutBaggage(trace.ContextWithSpanContext(ctx, trace.SpanContext{}))
}

// LimitBaggage returns ctx with its baggage reduced to what may be stored
// with an event: the members named in keys, in that order, as long as the
// encoded baggage stays within maxBytes (a member that would pass it is
// left out). A client's baggage is free text sent on every request; stored
// in every outbox row and carried to every consumer, it must be bounded.
// keys empty: no baggage; maxBytes 0 or less: no size limit.
func LimitBaggage(ctx context.Context, keys []string, maxBytes int) context.Context {
	in := baggage.FromContext(ctx)
	if in.Len() == 0 {
		return ctx
	}
	out := baggage.Baggage{}
	for _, k := range keys {
		m := in.Member(k)
		if m.Key() == "" {
			continue
		}
		next, err := out.SetMember(m)
		if err != nil || maxBytes > 0 && len(next.String()) > maxBytes {
			continue
		}
		out = next
	}
	if out.Len() == 0 {
		return baggage.ContextWithoutBaggage(ctx)
	}
	return baggage.ContextWithBaggage(ctx, out)
}

// InjectHeaders writes the trace context and baggage of ctx into headers
// with propagator (W3C Trace Context and Baggage when nil) and returns
// headers, allocated when nil and something is written. A writer calls it in
// the event's create span, after LimitBaggage, so the event carries that
// span's context and the baggage it allows. When ctx carries no valid span
// context and no baggage, nothing is written: no trace is invented.
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
// read with propagator (W3C Trace Context and Baggage when nil): the
// creation context a consumer links to, or a tool that replays an event
// continues from.
func Extract(ctx context.Context, propagator propagation.TextMapPropagator, headers map[string]string) context.Context {
	if propagator == nil {
		propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	return propagator.Extract(ctx, propagation.MapCarrier(headers))
}

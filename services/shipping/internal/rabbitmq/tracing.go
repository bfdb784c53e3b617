package rabbitmq

import (
	"cmp"
	"context"
	"errors"
	"maps"
	"net"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// ScopeName is the instrumentation scope of the consumer's spans.
const ScopeName = "github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"

// The headers the propagator reads and writes (W3C Trace Context and
// Baggage).
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
	HeaderBaggage     = "baggage"
)

// The consumer's span attributes beside the messaging conventions' ones.
const (
	// AttrRedelivered (bool): the broker's redelivered flag.
	AttrRedelivered = attribute.Key("shipping.redelivered")
	// AttrDeliveryCount (int): the quorum queue's x-delivery-count (earlier
	// returns of this message to the queue), when present.
	AttrDeliveryCount = attribute.Key("shipping.delivery_count")
	// AttrRetry (int): how many times this delivery was handled before in
	// this process (a Retry verdict keeps it: MongoDB was unavailable).
	AttrRetry = attribute.Key("shipping.retry")
	// AttrVerdict: what became of the delivery: ack, defer, dead_letter,
	// retry.
	AttrVerdict = attribute.Key("shipping.verdict")
	// AttrReason: a defer's or a dead letter's reason.
	AttrReason = attribute.Key("shipping.verdict.reason")
)

// HeaderCarrier adapts AMQP headers to propagation.TextMapCarrier. Get reads
// string values only (the W3C headers are strings); Set writes strings.
type HeaderCarrier amqp.Table

var _ propagation.TextMapCarrier = HeaderCarrier(nil)

// Get returns the string value of key, or "".
func (c HeaderCarrier) Get(key string) string {
	switch v := c[key].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

// Set sets key to value.
func (c HeaderCarrier) Set(key, value string) { c[key] = value }

// Keys lists the keys.
func (c HeaderCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// DefaultParentMaxAge is ConsumerConfig.ParentMaxAge's default.
const DefaultParentMaxAge = 30 * time.Second

// HeaderCreatedAt is the outbox row's creation time the relay sends
// (RFC 3339, to the microsecond; docs/events.md): the event's age. In the
// CloudEvents envelope the time attribute says it.
const HeaderCreatedAt = shipment.HeaderCreatedAt

// tracing holds the consumer's tracer; on is false for a no-op provider,
// which skips every span (the delivery's context is still extracted, so a
// handler sees its trace id and baggage, and the copies carry them on).
type tracing struct {
	tracer       trace.Tracer
	prop         propagation.TextMapPropagator
	on           bool
	ackName      string
	queue        attribute.KeyValue
	parentMaxAge time.Duration
	now          func() time.Time
}

func newTracing(tp trace.TracerProvider, prop propagation.TextMapPropagator, queue string, parentMaxAge time.Duration) tracing {
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	if parentMaxAge == 0 {
		parentMaxAge = DefaultParentMaxAge
	}
	_, off := tp.(noop.TracerProvider)
	return tracing{
		tracer: tp.Tracer(ScopeName), prop: prop, on: !off,
		ackName:      "ack " + queue,
		queue:        semconv.MessagingDestinationSubscriptionName(queue),
		parentMaxAge: parentMaxAge,
		now:          time.Now,
	}
}

// serverAttrs returns server.address and server.port of a node's
// host:port.
func serverAttrs(node string) []attribute.KeyValue {
	host, port, err := net.SplitHostPort(node)
	if err != nil {
		return nil
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return nil
	}
	return []attribute.KeyValue{semconv.ServerAddress(host), semconv.ServerPort(p)}
}

// young reports whether d's event is younger than the parent age limit; an
// event without a readable creation time counts as young.
func (t *tracing) young(d *amqp.Delivery) bool {
	if t.parentMaxAge < 0 {
		return false
	}
	created, ok := shipment.CreatedAt(d.Headers)
	if !ok {
		return true
	}
	return t.now().Sub(created) <= t.parentMaxAge
}

// extract returns ctx with d's trace context and baggage.
func (t *tracing) extract(ctx context.Context, d *amqp.Delivery) context.Context {
	if len(d.Headers) == 0 {
		return ctx
	}
	carrier := HeaderCarrier(d.Headers)
	if carrier.Get(HeaderTraceparent) == "" {
		// A CloudEvents event whose producer set only the distributed
		// tracing extension: its creation context.
		if tp, ok := shipment.CloudEventAttr(d.Headers, HeaderTraceparent); ok {
			carrier = maps.Clone(carrier)
			carrier[HeaderTraceparent] = tp
			delete(carrier, HeaderTracestate)
			if ts, ok := shipment.CloudEventAttr(d.Headers, HeaderTracestate); ok {
				carrier[HeaderTracestate] = ts
			}
		}
	}
	return t.prop.Extract(ctx, carrier)
}

// startProcess starts d's process span (CONSUMER), named "process" and the
// exchange it came through, as its messaging.destination.name says. ctx
// holds the context extracted from d's headers: the creation context of an
// event from the relay, or the context of the span that republished a copy.
// The span links to it, and is its child while the event is young (see
// ParentMaxAge) or when that context is unsampled (nothing is recorded
// then); an old event's span is the root of a trace of its own, so that an
// outage does not stretch one trace over hours. Without a context it is a
// new root. retry counts the earlier handlings of d in this session. The
// span is nil with tracing off.
func (t *tracing) startProcess(ctx context.Context, d *amqp.Delivery, retry int, server []attribute.KeyValue) (context.Context, trace.Span) {
	if !t.on {
		return ctx, nil
	}
	name := "process"
	if d.Exchange != "" {
		name += " " + d.Exchange
	}
	attrs := make([]attribute.KeyValue, 0, 14)
	attrs = append(attrs,
		semconv.MessagingSystemRabbitMQ,
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(d.Exchange),
		t.queue,
		semconv.MessagingMessageID(d.MessageId),
		semconv.MessagingRabbitMQMessageDeliveryTag(int(d.DeliveryTag)),
		semconv.MessagingMessageBodySize(len(d.Body)),
		AttrRedelivered.Bool(d.Redelivered),
	)
	if d.RoutingKey != "" {
		attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(d.RoutingKey))
	}
	if n, ok := d.Headers["x-delivery-count"].(int64); ok {
		attrs = append(attrs, AttrDeliveryCount.Int64(n))
	}
	if retry > 0 {
		attrs = append(attrs, AttrRetry.Int(retry))
	}
	attrs = append(attrs, server...)
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...)}
	if carried := trace.SpanContextFromContext(ctx); carried.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: carried}))
		if carried.IsSampled() && !t.young(d) {
			opts = append(opts, trace.WithNewRoot())
		}
	}
	return t.tracer.Start(ctx, name, opts...)
}

// endProcess ends a process span with the verdict and its outcome: a dead
// letter, a retry, a failed handler run or a settle that failed is an
// error.
func endProcess(span trace.Span, v shipment.Verdict, err error) {
	if span == nil {
		return
	}
	span.SetAttributes(AttrVerdict.String(v.Action.String()))
	if v.Reason != "" {
		span.SetAttributes(AttrReason.String(v.Reason))
	}
	// error.type, low-cardinality: the verdict's reason, or what failed.
	switch {
	case err != nil:
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		span.SetAttributes(semconv.ErrorTypeOther)
	case v.Action == shipment.DeadLetter:
		span.SetStatus(codes.Error, "dead-lettered: "+v.Reason+": "+v.Detail)
		span.SetAttributes(semconv.ErrorTypeKey.String(cmp.Or(v.Reason, "dead_letter")))
	case v.Action == shipment.Retry:
		span.SetStatus(codes.Error, "kept for a retry: a dependency is unavailable")
		span.SetAttributes(semconv.ErrorTypeKey.String("dependency_unavailable"))
	case v.Action == shipment.Defer && (v.Reason == "retry" || v.Reason == "transient" || v.Reason == "database"):
		span.SetStatus(codes.Error, "deferred: "+v.Reason)
		span.SetAttributes(semconv.ErrorTypeKey.String(v.Reason))
	}
	span.End()
}

// startPublish starts the PRODUCER span of a republished copy of d (to the
// delay queue or the dead-letter exchange), a child of the process span in
// ctx, and writes its context, with the delivery's baggage, into msg's
// headers in place of the copied ones. With tracing off, the delivery's own
// context is written (the same trace, the sampled flag kept).
func (t *tracing) startPublish(ctx context.Context, exchange, key, reason string, msg *amqp.Publishing) (context.Context, trace.Span) {
	var span trace.Span
	if t.on && trace.SpanFromContext(ctx).IsRecording() {
		name := "publish " + exchange
		if exchange == "" {
			name = "publish " + key // the default exchange routes to the queue named key
		}
		attrs := []attribute.KeyValue{
			semconv.MessagingSystemRabbitMQ,
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("publish"),
			semconv.MessagingDestinationName(exchange),
			semconv.MessagingMessageID(msg.MessageId),
			semconv.MessagingMessageBodySize(len(msg.Body)),
			AttrReason.String(reason),
		}
		if key != "" {
			attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(key))
		}
		ctx, span = t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
	}
	if msg.Headers == nil {
		msg.Headers = amqp.Table{}
	}
	// Replace, never merge: what the context lacks must not survive from the
	// copied headers.
	delete(msg.Headers, HeaderTraceparent)
	delete(msg.Headers, HeaderTracestate)
	delete(msg.Headers, HeaderBaggage)
	t.prop.Inject(ctx, HeaderCarrier(msg.Headers))
	return ctx, span
}

// startAck starts the settle span (CLIENT) of d's ack, a child of the
// process span in ctx; nil with tracing off or under a non-recording span.
func (t *tracing) startAck(ctx context.Context, d *amqp.Delivery) trace.Span {
	if !t.on || !trace.SpanFromContext(ctx).IsRecording() {
		return nil
	}
	_, span := t.tracer.Start(ctx, t.ackName, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(
		semconv.MessagingSystemRabbitMQ,
		semconv.MessagingOperationTypeSettle,
		semconv.MessagingOperationName("ack"),
		semconv.MessagingDestinationName(d.Exchange),
		t.queue,
		semconv.MessagingMessageID(d.MessageId),
		semconv.MessagingRabbitMQMessageDeliveryTag(int(d.DeliveryTag)),
	))
	return span
}

// endSpan ends a child span (a republished copy's publish, an ack),
// recording err and its error.type.
func endSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		span.SetAttributes(semconv.ErrorTypeKey.String(ErrorType(err)))
	}
	span.End()
}

// The error.type values of failed publish and ack spans, beside an AMQP
// reply code (e.g. "406") and the conventions' fallback "_OTHER".
const (
	ErrorTypeUnroutable    = "unroutable"         // ErrReturned
	ErrorTypeNoExchange    = "exchange_not_found" // the broker closed the channel: no such exchange
	ErrorTypeNacked        = "nacked"
	ErrorTypeTimeout       = "timeout"        // no confirm in time, a context deadline
	ErrorTypeChannelClosed = "channel_closed" // the channel or connection is gone
)

// ErrorType is a publish's or an ack's error as error.type: a
// low-cardinality class, not the message.
func ErrorType(err error) string {
	var amqpErr *amqp.Error
	switch {
	case errors.Is(err, ErrReturned):
		return ErrorTypeUnroutable
	case errors.Is(err, errNoExchange):
		return ErrorTypeNoExchange
	case errors.Is(err, errNacked):
		return ErrorTypeNacked
	case errors.Is(err, errConfirmTimeout), errors.Is(err, context.DeadlineExceeded):
		return ErrorTypeTimeout
	case errors.Is(err, errPublisherClosed), errors.Is(err, amqp.ErrClosed):
		return ErrorTypeChannelClosed
	case errors.As(err, &amqpErr):
		return strconv.Itoa(amqpErr.Code)
	default:
		return semconv.ErrorTypeOther.Value.AsString()
	}
}

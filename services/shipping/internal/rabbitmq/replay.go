package rabbitmq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// ReplayPublisher re-publishes kept messages (a replayed dead letter, the
// parked messages a release lets go) straight to the consumer's queue
// (through the default exchange, so no other consumer of the producers'
// exchange sees them again), persistent and mandatory, with a publisher
// confirm. It keeps one connection, opened at the first Publish and opened
// again after a failure, and publishes one message at a time: a release
// re-publishes an order's parked messages one after the other. Close it when
// done. Use it through a pointer; its zero value (with URL and Queue set) is
// ready.
type ReplayPublisher struct {
	// URL is the broker; its path is the vhost. For a cluster it lists the
	// nodes' URLs separated by commas, tried in turn (amqpaddr).
	URL   string
	Queue string // the consumer's queue
	// ConfirmTimeout bounds each Publish, from the dial (when a connection
	// must be opened) to the broker's confirm, whatever the deadline of the
	// context it is called with: a broker that takes the message and never
	// confirms it (a resource alarm, a cut that sends no reset) fails the
	// Publish instead of blocking the release behind it. Default:
	// DefaultConfirmTimeout.
	ConfirmTimeout time.Duration
	// TracerProvider, when set, gives each Publish a span "publish
	// <queue>" (kind PRODUCER) whose parent is the trace context kept in
	// the message's headers, so a replayed or released message stays in its
	// original trace; the context Publish is called with (an operator's
	// request) is linked. Default: nil, no span (the kept headers go out as
	// they are, in the original trace all the same).
	TracerProvider trace.TracerProvider
	// Propagator reads and writes the trace headers. Default: W3C Trace
	// Context and Baggage.
	Propagator propagation.TextMapPropagator

	mu      sync.Mutex
	nodes   *amqpaddr.Nodes
	conn    *amqp.Connection
	ch      *amqp.Channel
	returns <-chan amqp.Return
}

// Publish sends m and waits for the broker's confirm, at most
// ConfirmTimeout.
func (p *ReplayPublisher) Publish(ctx context.Context, m shipment.KeptMessage) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	timeout := cmp.Or(p.ConfirmTimeout, DefaultConfirmTimeout)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := p.open(timeout); err != nil {
		return err
	}
	headers := amqp.Table{}
	for k, v := range m.Headers {
		headers[k] = v
	}
	if err := headers.Validate(); err != nil {
		return fmt.Errorf("publish message %s: headers: %w", m.MessageID, err)
	}
	ctx, span := p.startSpan(ctx, m, headers)
	defer span.End()
	err := p.publish(ctx, m, headers)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		span.SetAttributes(semconv.ErrorTypeKey.String(ErrorType(err)))
		// Whatever failed (the connection, a confirm that never came), the
		// next Publish starts on a fresh connection: a late confirm or
		// return of this message must not be taken for the next one's.
		p.closeLocked()
	}
	return err
}

// Close closes the connection, if one is open. A later Publish opens a new
// one.
func (p *ReplayPublisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closeLocked()
}

func (p *ReplayPublisher) closeLocked() error {
	if p.conn == nil {
		return nil
	}
	err := p.conn.Close()
	p.conn, p.ch, p.returns = nil, nil, nil
	if errors.Is(err, amqp.ErrClosed) {
		err = nil
	}
	return err
}

// open makes sure a connection and a confirming channel are open.
func (p *ReplayPublisher) open(timeout time.Duration) error {
	if p.conn != nil && !p.conn.IsClosed() && p.ch != nil && !p.ch.IsClosed() {
		return nil
	}
	_ = p.closeLocked()
	if p.nodes == nil {
		nodes, err := amqpaddr.New(p.URL)
		if err != nil {
			return fmt.Errorf("broker URL: %w", err)
		}
		p.nodes = nodes
	}
	conn, _, err := p.nodes.Dial(amqp.Config{Heartbeat: 10 * time.Second, Dial: amqp.DefaultDial(min(timeout, 30*time.Second)),
		Properties: amqp.Table{"connection_name": "shipping dead-letter republisher"}})
	if err != nil {
		return fmt.Errorf("dial broker: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = conn.Close()
		return fmt.Errorf("enable confirms: %w", err)
	}
	// A return is dispatched before the confirm that follows it.
	p.conn, p.ch, p.returns = conn, ch, ch.NotifyReturn(make(chan amqp.Return, 1))
	return nil
}

// startSpan starts Publish's span, a child of the context in headers (kept
// with the message), and writes the span's context into headers in place
// of the kept one.
func (p *ReplayPublisher) startSpan(ctx context.Context, m shipment.KeptMessage, headers amqp.Table) (context.Context, trace.Span) {
	if p.TracerProvider == nil {
		return ctx, trace.SpanFromContext(context.Background()) // a no-op span
	}
	prop := p.Propagator
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	opts := []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(
			semconv.MessagingSystemRabbitMQ,
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("publish"),
			semconv.MessagingDestinationName(""),
			semconv.MessagingRabbitMQDestinationRoutingKey(p.Queue),
			semconv.MessagingMessageID(m.MessageID),
			semconv.MessagingMessageBodySize(len(m.Body)),
			attribute.Bool("shipping.republish", true),
		),
	}
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: sc}))
	}
	// The operator's request is linked, not inherited: neither its span nor
	// its baggage may stand in for what the kept headers lack.
	base := baggage.ContextWithoutBaggage(trace.ContextWithSpanContext(ctx, trace.SpanContext{}))
	kept := prop.Extract(base, HeaderCarrier(headers))
	ctx, span := p.TracerProvider.Tracer(ScopeName).Start(kept, "publish "+p.Queue, opts...)
	delete(headers, HeaderTraceparent)
	delete(headers, HeaderTracestate)
	delete(headers, HeaderBaggage)
	prop.Inject(ctx, HeaderCarrier(headers))
	return ctx, span
}

func (p *ReplayPublisher) publish(ctx context.Context, m shipment.KeptMessage, headers amqp.Table) error {
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, "", p.Queue, true, false, amqp.Publishing{
		MessageId: m.MessageID, Type: m.Type, ContentType: m.ContentType, DeliveryMode: amqp.Persistent,
		Timestamp: time.Now(), Headers: headers, Body: m.Body,
	})
	if err != nil {
		return fmt.Errorf("publish message %s to %s: %w", m.MessageID, p.Queue, err)
	}
	ok, err := dc.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("publish message %s to %s: waiting for confirm: %w", m.MessageID, p.Queue, err)
	}
	if !ok {
		return fmt.Errorf("publish message %s to %s: nacked", m.MessageID, p.Queue)
	}
	select {
	case <-p.returns:
		return fmt.Errorf("publish message %s: queue %s does not exist: %w", m.MessageID, p.Queue, ErrReturned)
	default:
	}
	return nil
}

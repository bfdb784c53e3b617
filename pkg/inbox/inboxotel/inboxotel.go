// Package inboxotel traces package inbox's work with OpenTelemetry: the
// inbox check and the record as spans (through inbox.Hooks), and the
// handler's effect as a span of its own, all children of the span in the
// context given to Process (typically a messaging "process" span).
//
//	tr := inboxotel.New(tracerProvider)
//	in, err := inbox.New(db, inbox.Config{Consumer: "shipping", Hooks: tr.Hooks()})
//	res, err := in.Process(ctx, msgID, tr.Handler("apply shipment", apply))
//
// Spans (kind INTERNAL):
//
//   - "inbox check": StepCheck. Attributes messaging.message.id,
//     inbox.duplicate (the message was recorded already: the handler does
//     not run, and no effect span follows), inbox.cached (answered by the
//     done cache, without a database operation).
//   - "inbox record": StepRecord. Attributes messaging.message.id,
//     inbox.buffered (the record went into the buffer, written by the
//     flusher later).
//   - the handler's span, named by the caller.
//
// A step that failed records its error and sets the span's status to
// Error. Spans are started only under a recording span: under an unsampled
// or no-op parent nothing is started and nothing allocated, and the handler
// runs with the context it was given (its trace id and baggage intact).
//
// It depends on the OpenTelemetry API only (go.opentelemetry.io/otel/trace
// and attribute, codes); the SDK, exporter and sampler are the caller's.
package inboxotel

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/pkg/inbox"
)

// ScopeName is the instrumentation scope of the spans.
const ScopeName = "github.com/outbox-inbox/reference/pkg/inbox/inboxotel"

// Span names.
const (
	SpanCheck  = "inbox check"
	SpanRecord = "inbox record"
)

// Attribute keys.
const (
	// AttrDuplicate (bool) is set on the check span: the message was
	// recorded already.
	AttrDuplicate = attribute.Key("inbox.duplicate")
	// AttrCached (bool) is set on the check span: the done cache answered.
	AttrCached = attribute.Key("inbox.cached")
	// AttrBuffered (bool) is set on the record span: the record was
	// buffered.
	AttrBuffered = attribute.Key("inbox.buffered")
	// AttrMessageID is the message id (the OpenTelemetry messaging
	// convention's messaging.message.id).
	AttrMessageID = attribute.Key("messaging.message.id")
)

// Tracing starts the spans. Its zero value is not usable: call New.
type Tracing struct {
	tracer trace.Tracer
}

// New returns a Tracing whose spans come from tp. A nil tp traces nothing.
func New(tp trace.TracerProvider) *Tracing {
	if tp == nil {
		return &Tracing{}
	}
	return &Tracing{tracer: tp.Tracer(ScopeName)}
}

// stepSpanKey marks a step's context that holds a span this package started
// (so EndStep never ends the parent's).
type stepSpanKey struct{}

// Hooks returns the inbox.Hooks that trace the check and the record.
func (t *Tracing) Hooks() inbox.Hooks {
	if t.tracer == nil {
		return inbox.Hooks{}
	}
	return inbox.Hooks{StartStep: t.startStep, EndStep: endStep}
}

func (t *Tracing) startStep(ctx context.Context, step inbox.Step, msgID string) context.Context {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx
	}
	name := SpanCheck
	if step == inbox.StepRecord {
		name = SpanRecord
	}
	ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(AttrMessageID.String(msgID)))
	return context.WithValue(ctx, stepSpanKey{}, span)
}

func endStep(ctx context.Context, step inbox.Step, _ string, r inbox.StepResult) {
	span, ok := ctx.Value(stepSpanKey{}).(trace.Span)
	if !ok {
		return
	}
	switch step {
	case inbox.StepCheck:
		span.SetAttributes(AttrDuplicate.Bool(r.Duplicate), AttrCached.Bool(r.Cached))
	case inbox.StepRecord:
		span.SetAttributes(AttrBuffered.Bool(r.Buffered))
	}
	if r.Err != nil {
		span.RecordError(r.Err)
		span.SetStatus(codes.Error, r.Err.Error())
	}
	span.End()
}

// Handler returns h run inside a span named name (kind INTERNAL, with
// attrs), a child of the span in the context the inbox gives it, when that
// span is recording. The handler sees its span in its context (to add
// attributes); an error it returns is recorded and sets the status to
// Error.
func (t *Tracing) Handler(name string, h inbox.Handler, attrs ...attribute.KeyValue) inbox.Handler {
	if t.tracer == nil {
		return h
	}
	return func(ctx context.Context) error {
		if !trace.SpanFromContext(ctx).IsRecording() {
			return h(ctx)
		}
		ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...))
		defer span.End()
		err := h(ctx)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		return err
	}
}

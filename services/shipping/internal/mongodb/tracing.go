package mongodb

import (
	"context"
	"net"
	"strconv"
	"strings"
	"sync"

	"go.mongodb.org/mongo-driver/v2/event"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// TracerScope is the instrumentation scope of the command spans.
const TracerScope = "github.com/outbox-inbox/reference/services/shipping/internal/mongodb"

// CommandMonitor returns a driver monitor that gives every MongoDB command
// run under a recording span a CLIENT span of its own, named after the
// command and its collection ("insert inbox"), with the database semantic
// conventions' attributes. Commands without a recording span in their
// context (the driver's own, or with tracing off) get none.
//
// OpenTelemetry contrib's otelmongo does this for mongo-driver v1; its
// module for v2 is not served by the Go module proxy this repository
// builds from, so this is the same idea, small.
func CommandMonitor(tp trace.TracerProvider) *event.CommandMonitor {
	m := &commandMonitor{tracer: tp.Tracer(TracerScope)}
	return &event.CommandMonitor{Started: m.started, Succeeded: m.succeeded, Failed: m.failed}
}

type commandMonitor struct {
	tracer trace.Tracer
	spans  sync.Map // request id -> trace.Span
}

func (m *commandMonitor) started(ctx context.Context, e *event.CommandStartedEvent) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return
	}
	collection := ""
	if v, err := e.Command.LookupErr(e.CommandName); err == nil {
		collection, _ = v.StringValueOK()
	}
	name := e.CommandName
	if collection != "" {
		name += " " + collection
	}
	attrs := []attribute.KeyValue{
		semconv.DBSystemNameMongoDB,
		semconv.DBNamespace(e.DatabaseName),
		semconv.DBOperationName(e.CommandName),
	}
	if collection != "" {
		attrs = append(attrs, semconv.DBCollectionName(collection))
	}
	// ConnectionID is host:port[-n].
	addr := e.ConnectionID
	if i := strings.LastIndexByte(addr, '-'); i > strings.LastIndexByte(addr, ':') {
		addr = addr[:i]
	}
	if host, port, err := net.SplitHostPort(addr); err == nil {
		attrs = append(attrs, semconv.ServerAddress(host))
		if p, err := strconv.Atoi(port); err == nil {
			attrs = append(attrs, semconv.ServerPort(p))
		}
	}
	_, span := m.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
	m.spans.Store(e.RequestID, span)
}

func (m *commandMonitor) succeeded(_ context.Context, e *event.CommandSucceededEvent) {
	if s, ok := m.spans.LoadAndDelete(e.RequestID); ok {
		s.(trace.Span).End()
	}
}

func (m *commandMonitor) failed(_ context.Context, e *event.CommandFailedEvent) {
	s, ok := m.spans.LoadAndDelete(e.RequestID)
	if !ok {
		return
	}
	span := s.(trace.Span)
	span.RecordError(e.Failure)
	span.SetStatus(codes.Error, e.Failure.Error())
	span.SetAttributes(semconv.ErrorTypeOther)
	span.End()
}

// Package logfmt builds the services' structured loggers, so every process
// logs the same JSON shape.
package logfmt

import (
	"context"
	"io"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// New returns a JSON logger at level writing to w, tagged with the service's
// name. Durations are written as text ("1.5s"), not as raw nanoseconds. A
// line logged with a context that carries a span (the ...Context methods)
// gets that span's trace_id and span_id, so logs and traces join.
func New(w io.Writer, level slog.Leveler, service string) *slog.Logger {
	return slog.New(WithTrace(slog.NewJSONHandler(w, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindDuration {
				return slog.String(a.Key, a.Value.Duration().Round(time.Microsecond).String())
			}
			return a
		},
	}))).With("service", service)
}

// WithTrace returns h adding trace_id and span_id to every record logged
// with a context that holds a valid span context (recorded or not: an
// unsampled trace's id still joins the logs of its request).
func WithTrace(h slog.Handler) slog.Handler {
	if _, ok := h.(traceHandler); ok {
		return h
	}
	return traceHandler{h}
}

type traceHandler struct{ slog.Handler }

var _ slog.Handler = traceHandler{}

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		r.AddAttrs(slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String()))
	}
	return h.Handler.Handle(ctx, r)
}

func (h traceHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return traceHandler{h.Handler.WithAttrs(attrs)}
}

func (h traceHandler) WithGroup(name string) slog.Handler {
	return traceHandler{h.Handler.WithGroup(name)}
}

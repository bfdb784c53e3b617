// Package logfmt builds the services' structured loggers, so every process
// logs the same JSON shape.
package logfmt

import (
	"context"
	"io"
	"log/slog"
	"slices"
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
// unsampled trace's id still joins the logs of its request). They are
// top-level keys of the record even under a group (logger.WithGroup), where
// a log backend looks for them.
func WithTrace(h slog.Handler) slog.Handler {
	if _, ok := h.(traceHandler); ok {
		return h
	}
	return traceHandler{Handler: h}
}

// traceHandler is Handler (with all its attributes and groups) and, once a
// group was opened, top: the handler before the first group, and rest: the
// attributes and groups added since, in order, to replay on top under the
// trace ids.
type traceHandler struct {
	slog.Handler
	top  slog.Handler
	rest []func(slog.Handler) slog.Handler
}

var _ slog.Handler = traceHandler{}

func (h traceHandler) Handle(ctx context.Context, r slog.Record) error {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return h.Handler.Handle(ctx, r)
	}
	ids := []slog.Attr{slog.String("trace_id", sc.TraceID().String()), slog.String("span_id", sc.SpanID().String())}
	if h.top == nil {
		r.AddAttrs(ids...)
		return h.Handler.Handle(ctx, r)
	}
	// Under a group the record's attributes land in it: the ids go on the
	// handler before the group, and the groups are opened again after them.
	g := h.top.WithAttrs(ids)
	for _, f := range h.rest {
		g = f(g)
	}
	return g.Handle(ctx, r)
}

func (h traceHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	out := traceHandler{Handler: h.Handler.WithAttrs(attrs), top: h.top}
	if h.top != nil {
		out.rest = append(slices.Clip(h.rest), func(g slog.Handler) slog.Handler { return g.WithAttrs(attrs) })
	}
	return out
}

func (h traceHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	out := traceHandler{Handler: h.Handler.WithGroup(name), top: h.top, rest: slices.Clip(h.rest)}
	if out.top == nil {
		out.top = h.Handler
	}
	out.rest = append(out.rest, func(g slog.Handler) slog.Handler { return g.WithGroup(name) })
	return out
}

// Package tracing sets up OpenTelemetry tracing for the services from the
// standard OTEL_* environment variables, and nothing else.
//
// The decision, in order:
//
//   - OTEL_SDK_DISABLED=true: no tracing.
//   - OTEL_TRACES_EXPORTER=none: no tracing.
//   - OTEL_TRACES_EXPORTER=console: spans are written as JSON lines to stderr.
//   - OTEL_TRACES_EXPORTER=otlp, or unset while OTEL_EXPORTER_OTLP_ENDPOINT or
//     OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set: spans are exported with
//     OTLP over HTTP (http/protobuf). The exporter reads its own variables
//     (endpoint, headers, timeout, TLS, compression); OTEL_EXPORTER_OTLP_PROTOCOL
//     (or _TRACES_PROTOCOL) must be unset or http/protobuf.
//   - otherwise (nothing configured): no tracing.
//
// "No tracing" is a no-op TracerProvider: spans are neither recorded nor
// exported, and starting one costs next to nothing. The propagator is W3C
// Trace Context plus Baggage in every case, and a no-op span carries its
// parent's span context, so a process with tracing off still passes an
// incoming trace (its sampled flag included) and baggage on unchanged.
//
// With tracing on, the SDK reads the rest itself: OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES for the resource (the service's default name is
// used when neither names one), OTEL_TRACES_SAMPLER and
// OTEL_TRACES_SAMPLER_ARG for the sampler (parentbased_always_on by
// default), OTEL_BSP_* for the batch span processor.
//
// Nothing here touches OpenTelemetry's global state: the provider and the
// propagator are handed to whoever needs them.
package tracing

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Telemetry is what a service needs to trace: a TracerProvider to start
// spans with, the propagator that reads and writes trace context and baggage
// in headers, and Shutdown to flush what is buffered before exit.
type Telemetry struct {
	// TracerProvider is a no-op provider when tracing is off.
	TracerProvider trace.TracerProvider
	// Propagator is always W3C Trace Context plus W3C Baggage.
	Propagator propagation.TextMapPropagator
	// Shutdown flushes the spans not yet exported and stops the exporter.
	// It is never nil; with tracing off it does nothing.
	Shutdown func(context.Context) error
}

// Propagator returns the propagator the services use: W3C Trace Context
// (traceparent, tracestate) and W3C Baggage (baggage).
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// Disabled returns Telemetry with tracing off: a no-op provider and the
// usual propagator, for tests and tools that do not trace.
func Disabled() *Telemetry {
	return &Telemetry{
		TracerProvider: noop.NewTracerProvider(),
		Propagator:     Propagator(),
		Shutdown:       func(context.Context) error { return nil },
	}
}

// exporterKind is what the environment asks for.
type exporterKind int

const (
	exportNone exporterKind = iota
	exportOTLP
	exportConsole
)

func (k exporterKind) String() string {
	switch k {
	case exportOTLP:
		return "otlp"
	case exportConsole:
		return "console"
	default:
		return "none"
	}
}

// decision is what decide reads from the environment.
type decision struct {
	exporter exporterKind
	// reason says why, for the log line.
	reason string
}

// decide reads the OTEL_* variables that choose whether and where to
// export. getenv is os.Getenv outside tests.
func decide(getenv func(string) string) (decision, error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return decision{exportNone, "OTEL_SDK_DISABLED=true"}, nil
	}
	endpoint := strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
	if endpoint == "" {
		endpoint = strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_ENDPOINT"))
	}
	kind := exportNone
	reason := "no OTEL_TRACES_EXPORTER and no OTEL_EXPORTER_OTLP_ENDPOINT"
	if v := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); v != "" {
		// The variable is a comma-separated list; one exporter is supported
		// at a time, and "none" anywhere wins as the spec says.
		names := strings.Split(v, ",")
		chosen := ""
		for _, n := range names {
			n = strings.ToLower(strings.TrimSpace(n))
			if n == "" {
				continue
			}
			if n == "none" {
				return decision{exportNone, "OTEL_TRACES_EXPORTER=none"}, nil
			}
			if chosen != "" && chosen != n {
				return decision{}, fmt.Errorf("tracing: OTEL_TRACES_EXPORTER=%q: only one exporter at a time is supported", v)
			}
			chosen = n
		}
		switch chosen {
		case "otlp":
			kind, reason = exportOTLP, "OTEL_TRACES_EXPORTER=otlp"
		case "console":
			kind, reason = exportConsole, "OTEL_TRACES_EXPORTER=console"
		case "":
			// Only separators: as if unset.
		default:
			return decision{}, fmt.Errorf("tracing: OTEL_TRACES_EXPORTER=%q: want otlp, console or none", v)
		}
	}
	if kind == exportNone && reason != "OTEL_TRACES_EXPORTER=none" && endpoint != "" {
		kind, reason = exportOTLP, "OTEL_EXPORTER_OTLP_ENDPOINT is set"
	}
	if kind == exportOTLP {
		proto := strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
		if proto == "" {
			proto = strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_PROTOCOL"))
		}
		if proto != "" && proto != "http/protobuf" {
			return decision{}, fmt.Errorf("tracing: OTLP protocol %q is not supported: unset it or use http/protobuf (port 4318)", proto)
		}
	}
	return decision{kind, reason}, nil
}

// Setup reads the environment and returns the services' Telemetry. It fails
// only on a configuration it cannot honour (an unknown exporter or
// protocol, a malformed OTLP endpoint); an unreachable collector is not an
// error: spans that cannot be exported are dropped, and the SDK reports
// that through its error handler.
func Setup(ctx context.Context, defaultServiceName string, logger *slog.Logger) (*Telemetry, error) {
	return setup(ctx, defaultServiceName, logger, os.Getenv, os.Stderr)
}

func setup(ctx context.Context, defaultServiceName string, logger *slog.Logger, getenv func(string) string, console io.Writer) (*Telemetry, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	d, err := decide(getenv)
	if err != nil {
		return nil, err
	}
	if d.exporter == exportNone {
		logger.Debug("tracing off", "reason", d.reason)
		return Disabled(), nil
	}
	var exp sdktrace.SpanExporter
	switch d.exporter {
	case exportOTLP:
		// The exporter reads OTEL_EXPORTER_OTLP_* itself (endpoint, headers,
		// timeout, compression, certificates).
		e, err := otlptracehttp.New(ctx)
		if err != nil {
			return nil, fmt.Errorf("tracing: OTLP/HTTP exporter: %w", err)
		}
		exp = e
	case exportConsole:
		exp = &consoleExporter{w: console}
	}
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(semconv.ServiceName(defaultServiceName)),
		// Later detectors win: OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
		// override the default name.
		resource.WithFromEnv(),
	)
	if err != nil {
		// A malformed OTEL_RESOURCE_ATTRIBUTES is reported but what could be
		// parsed is still returned, as the SDK does itself.
		if res == nil {
			_ = exp.Shutdown(ctx)
			return nil, fmt.Errorf("tracing: resource: %w", err)
		}
		logger.Warn("tracing: resource attributes partly ignored", "err", err)
	}
	// No WithSampler: the SDK reads OTEL_TRACES_SAMPLER(_ARG) itself.
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithResource(res),
	)
	name, _ := res.Set().Value(semconv.ServiceNameKey)
	logger.Info("tracing on", "exporter", d.exporter.String(), "reason", d.reason, "service_name", name.AsString())
	return &Telemetry{
		TracerProvider: tp,
		Propagator:     Propagator(),
		Shutdown: func(ctx context.Context) error {
			if err := tp.Shutdown(ctx); err != nil {
				return fmt.Errorf("tracing: shutdown: %w", err)
			}
			return nil
		},
	}, nil
}

// consoleExporter writes one JSON object per span, for
// OTEL_TRACES_EXPORTER=console.
type consoleExporter struct {
	mu sync.Mutex
	w  io.Writer
}

type consoleSpan struct {
	Name       string         `json:"name"`
	Kind       string         `json:"kind"`
	TraceID    string         `json:"trace_id"`
	SpanID     string         `json:"span_id"`
	ParentID   string         `json:"parent_span_id,omitempty"`
	Sampled    bool           `json:"sampled"`
	Start      string         `json:"start"`
	Duration   string         `json:"duration"`
	Status     string         `json:"status,omitempty"`
	StatusDesc string         `json:"status_description,omitempty"`
	Attributes map[string]any `json:"attributes,omitempty"`
	Links      []string       `json:"links,omitempty"`
	Service    string         `json:"service,omitempty"`
}

func (e *consoleExporter) ExportSpans(ctx context.Context, spans []sdktrace.ReadOnlySpan) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	enc := json.NewEncoder(e.w)
	for _, s := range spans {
		cs := consoleSpan{
			Name:     s.Name(),
			Kind:     s.SpanKind().String(),
			TraceID:  s.SpanContext().TraceID().String(),
			SpanID:   s.SpanContext().SpanID().String(),
			Sampled:  s.SpanContext().IsSampled(),
			Start:    s.StartTime().UTC().Format("2006-01-02T15:04:05.000000Z07:00"),
			Duration: s.EndTime().Sub(s.StartTime()).String(),
		}
		if s.Parent().IsValid() {
			cs.ParentID = s.Parent().SpanID().String()
		}
		if st := s.Status(); st.Code != 0 {
			cs.Status, cs.StatusDesc = st.Code.String(), st.Description
		}
		if attrs := s.Attributes(); len(attrs) > 0 {
			cs.Attributes = make(map[string]any, len(attrs))
			for _, kv := range attrs {
				cs.Attributes[string(kv.Key)] = kv.Value.AsInterface()
			}
		}
		for _, l := range s.Links() {
			cs.Links = append(cs.Links, l.SpanContext.TraceID().String()+"-"+l.SpanContext.SpanID().String())
		}
		if r := s.Resource(); r != nil {
			if v, ok := r.Set().Value(attribute.Key("service.name")); ok {
				cs.Service = v.AsString()
			}
		}
		if err := enc.Encode(cs); err != nil {
			return fmt.Errorf("tracing: console: %w", err)
		}
	}
	return ctx.Err()
}

func (e *consoleExporter) Shutdown(context.Context) error { return nil }

var _ sdktrace.SpanExporter = (*consoleExporter)(nil)

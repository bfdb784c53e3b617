// Package tracing sets up OpenTelemetry tracing for the services from the
// standard OTEL_* environment variables, with the SDK's own contrib
// packages: autoexport picks the span exporter, autoprop the propagator.
//
// Whether spans are exported, in order:
//
//   - OTEL_SDK_DISABLED=true: no tracing.
//   - OTEL_TRACES_EXPORTER=none: no tracing.
//   - OTEL_TRACES_EXPORTER=console: spans are written as JSON lines to
//     stderr by the SDK's stdout exporter (stdouttrace; stdout carries the
//     services' logs).
//   - OTEL_TRACES_EXPORTER=otlp, or unset while OTEL_EXPORTER_OTLP_ENDPOINT or
//     OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set: autoexport's OTLP exporter,
//     over OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL: http/protobuf (the default,
//     port 4318) or grpc (4317). The exporter reads its own variables
//     (endpoint, headers, timeout, TLS, compression).
//   - otherwise (nothing configured): no tracing. (autoexport alone would
//     export to localhost:4318 by default; a service run without a
//     collector should not try.)
//
// "No tracing" is a no-op TracerProvider: spans are neither recorded nor
// exported, and starting one costs next to nothing. The propagator is
// OTEL_PROPAGATORS (tracecontext, baggage, b3, b3multi, jaeger, xray,
// ottrace, none; autoprop), W3C Trace Context plus Baggage when unset, in
// every case: a no-op span carries its parent's span context, so a process
// with tracing off still passes an incoming trace (its sampled flag
// included) and baggage on unchanged.
//
// With tracing on, the SDK reads the rest itself: OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES for the resource (the service's default name is
// used when neither names one), OTEL_TRACES_SAMPLER and
// OTEL_TRACES_SAMPLER_ARG for the sampler (parentbased_always_on by
// default), OTEL_BSP_* for the batch span processor. The resource carries
// service.instance.id, a random UUID per process unless
// OTEL_RESOURCE_ATTRIBUTES sets one, so that replicas of one service (the
// relays) are told apart.
//
// service.version is the binary's version (Version), from its build
// information: nothing to set at build time.
//
// Nothing here touches OpenTelemetry's global state: the provider and the
// propagator are handed to whoever needs them.
package tracing

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/debug"
	"strings"

	"github.com/google/uuid"
	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/contrib/propagators/autoprop"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Version is the service.version of the process's resource: the main
// module's version in the binary's build information (a release tag, or
// the pseudo-version `go build` stamps from the VCS commit, such as
// v0.0.0-20260101120000-0123456789ab, with +dirty for a modified tree),
// else the VCS revision (12 digits, -dirty when modified), else "devel" (a
// build without VCS information, a test binary).
func Version() string { return version(debug.ReadBuildInfo) }

func version(read func() (*debug.BuildInfo, bool)) string {
	info, ok := read()
	if !ok {
		return "devel"
	}
	if v := info.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	rev, modified := "", false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if rev == "" {
		return "devel"
	}
	rev = rev[:min(len(rev), 12)]
	if modified {
		rev += "-dirty"
	}
	return rev
}

// Telemetry is what a service needs to trace: a TracerProvider to start
// spans with, the propagator that reads and writes trace context and baggage
// in headers, and Shutdown to flush what is buffered before exit.
type Telemetry struct {
	// TracerProvider is a no-op provider when tracing is off.
	TracerProvider trace.TracerProvider
	// Propagator is OTEL_PROPAGATORS', W3C Trace Context plus W3C Baggage
	// by default.
	Propagator propagation.TextMapPropagator
	// Shutdown flushes the spans not yet exported and stops the exporter.
	// It is never nil; with tracing off it does nothing.
	Shutdown func(context.Context) error
}

// Propagator returns the default propagator: W3C Trace Context
// (traceparent, tracestate) and W3C Baggage (baggage).
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// Disabled returns Telemetry with tracing off: a no-op provider and the
// default propagator, for tests and tools that do not trace.
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
	// exportAuto: autoexport's exporter for OTEL_TRACES_EXPORTER (otlp when
	// unset).
	exportAuto
	exportConsole
)

func (k exporterKind) String() string {
	switch k {
	case exportAuto:
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
	if v := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); v != "" {
		// The variable is a comma-separated list; one exporter is supported
		// at a time, and "none" anywhere wins as the spec says.
		chosen := ""
		for n := range strings.SplitSeq(v, ",") {
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
			return decision{exportAuto, "OTEL_TRACES_EXPORTER=otlp"}, nil
		case "console":
			return decision{exportConsole, "OTEL_TRACES_EXPORTER=console"}, nil
		case "":
			// Only separators: as if unset.
		default:
			return decision{}, fmt.Errorf("tracing: OTEL_TRACES_EXPORTER=%q: want otlp, console or none", v)
		}
	}
	if endpoint != "" {
		return decision{exportAuto, "OTEL_EXPORTER_OTLP_ENDPOINT is set"}, nil
	}
	return decision{exportNone, "no OTEL_TRACES_EXPORTER and no OTEL_EXPORTER_OTLP_ENDPOINT"}, nil
}

// propagatorFromEnv returns OTEL_PROPAGATORS' propagator (autoprop), or the
// default one when it is unset; an unknown name is an error, not a silent
// fallback.
func propagatorFromEnv(getenv func(string) string) (propagation.TextMapPropagator, error) {
	v := strings.TrimSpace(getenv("OTEL_PROPAGATORS"))
	if v == "" {
		return Propagator(), nil
	}
	var names []string
	for n := range strings.SplitSeq(v, ",") {
		if n = strings.TrimSpace(n); n != "" {
			names = append(names, n)
		}
	}
	p, err := autoprop.TextMapPropagator(names...)
	if err != nil {
		return nil, fmt.Errorf("tracing: OTEL_PROPAGATORS=%q: %w", v, err)
	}
	return p, nil
}

// Setup reads the environment and returns the services' Telemetry. It fails
// only on a configuration it cannot honour (an unknown exporter, protocol or
// propagator, a malformed OTLP endpoint); an unreachable collector is not an
// error: spans that cannot be exported are dropped, and the SDK reports that
// through its error handler.
func Setup(ctx context.Context, defaultServiceName string, logger *slog.Logger) (*Telemetry, error) {
	return setup(ctx, defaultServiceName, logger, os.Stderr)
}

func setup(ctx context.Context, defaultServiceName string, logger *slog.Logger, console io.Writer) (*Telemetry, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	prop, err := propagatorFromEnv(os.Getenv)
	if err != nil {
		return nil, err
	}
	d, err := decide(os.Getenv)
	if err != nil {
		return nil, err
	}
	if d.exporter == exportNone {
		logger.Debug("tracing off", "reason", d.reason)
		tel := Disabled()
		tel.Propagator = prop
		return tel, nil
	}
	var exp sdktrace.SpanExporter
	switch d.exporter {
	case exportAuto:
		// autoexport reads OTEL_TRACES_EXPORTER and
		// OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, the OTLP exporter the rest
		// of OTEL_EXPORTER_OTLP_*.
		exp, err = autoexport.NewSpanExporter(ctx)
	case exportConsole:
		exp, err = stdouttrace.New(stdouttrace.WithWriter(console))
	}
	if err != nil {
		return nil, fmt.Errorf("tracing: %s exporter: %w", d.exporter, err)
	}
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(semconv.ServiceName(defaultServiceName), semconv.ServiceInstanceID(uuid.NewString()),
			semconv.ServiceVersion(Version())),
		// Later detectors win: OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
		// override the default name, instance id and version.
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
	instance, _ := res.Set().Value(semconv.ServiceInstanceIDKey)
	ver, _ := res.Set().Value(semconv.ServiceVersionKey)
	logger.Info("tracing on", "exporter", d.exporter.String(), "reason", d.reason,
		"service_name", name.AsString(), "service_instance_id", instance.AsString(), "service_version", ver.AsString())
	return &Telemetry{
		TracerProvider: tp,
		Propagator:     prop,
		Shutdown: func(ctx context.Context) error {
			if err := tp.Shutdown(ctx); err != nil {
				return fmt.Errorf("tracing: shutdown: %w", err)
			}
			return nil
		},
	}, nil
}

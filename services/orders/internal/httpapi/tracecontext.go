package httpapi

import (
	"context"
	"net/http"
	"strings"

	"github.com/go-chi/chi/v5"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/baggage"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// The W3C Trace Context and Baggage headers a client sends are read by the
// OpenTelemetry propagator, and never fail a request: an invalid traceparent
// is ignored, so the request starts a new trace (and its tracestate is
// ignored with it); an invalid tracestate or baggage is dropped.
//
// With tracing on, every request but the probes (/healthz, /readyz,
// /metrics) gets a server span from otelhttp, named after its route
// ("POST /orders"). With tracing off (a no-op TracerProvider) there is no
// otelhttp and no span: the client's context and baggage are only
// extracted, so the events still carry them on.
//
// The API is public: whether a caller's context is believed is trusted's
// decision (Config.TrustTraceContext). A trusted caller's context is the
// server span's parent, and its baggage is kept. An untrusted caller's
// request starts a trace of its own, linked to the context it sent
// (otelhttp's public endpoint), and its baggage is dropped, so that nobody
// outside can make its requests part of someone else's trace, sample them
// in or out, or write baggage into the outbox rows; with tracing off,
// nothing of an untrusted caller's headers is kept.

// traced wraps h in the server span (tracing on) or in the extraction of the
// client's context (tracing off), for the callers trusted says to believe.
func traced(h http.Handler, tp trace.TracerProvider, prop propagation.TextMapPropagator, trusted func(*http.Request) bool) http.Handler {
	prop = requestPropagator{prop}
	if _, off := tp.(noop.TracerProvider); off {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			if !trusted(r) {
				h.ServeHTTP(w, r)
				return
			}
			if ext := prop.Extract(ctx, propagation.HeaderCarrier(r.Header)); ext != ctx {
				r = r.WithContext(ext)
			}
			h.ServeHTTP(w, r)
		})
	}
	untrustedBaggageDropped := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !trusted(r) {
			if ctx := r.Context(); baggage.FromContext(ctx).Len() > 0 {
				r = r.WithContext(baggage.ContextWithoutBaggage(ctx))
			}
		}
		h.ServeHTTP(w, r)
	})
	return otelhttp.NewHandler(untrustedBaggageDropped, "orders",
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(prop),
		otelhttp.WithPublicEndpointFn(func(r *http.Request) bool { return !trusted(r) }),
		// The service's metrics are Prometheus's (the requests' are
		// Config.Requests, by route); otelhttp's would go nowhere.
		otelhttp.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelhttp.WithFilter(func(r *http.Request) bool {
			switch r.URL.Path {
			case "/healthz", "/readyz", "/metrics":
				return false
			}
			return true
		}),
		// The route is known after routing; nameByRoute renames the span.
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return r.Method }),
	)
}

// nameByRoute is chi middleware: once the route matched, the server span is
// named "METHOD route" and gets http.route, as the HTTP semantic conventions
// ask. Unmatched requests keep the method alone.
func nameByRoute(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		next.ServeHTTP(w, r)
		span := trace.SpanFromContext(r.Context())
		if !span.IsRecording() {
			return
		}
		if rc := chi.RouteContext(r.Context()); rc != nil {
			if route := rc.RoutePattern(); route != "" && route != "/*" {
				span.SetName(r.Method + " " + route)
				span.SetAttributes(semconv.HTTPRoute(route))
			}
		}
	})
}

// requestPropagator reads a request's headers as the W3C specification
// does, where OpenTelemetry's HeaderCarrier takes the first field: a request
// with two traceparent fields has an invalid one, and several tracestate
// fields are one comma-separated list.
type requestPropagator struct{ propagation.TextMapPropagator }

func (p requestPropagator) Extract(ctx context.Context, c propagation.TextMapCarrier) context.Context {
	if h, ok := c.(propagation.HeaderCarrier); ok {
		c = requestCarrier{h}
	}
	return p.TextMapPropagator.Extract(ctx, c)
}

type requestCarrier struct{ propagation.HeaderCarrier }

func (c requestCarrier) Get(key string) string {
	switch strings.ToLower(key) {
	case "traceparent":
		if v := http.Header(c.HeaderCarrier).Values(key); len(v) == 1 {
			return v[0]
		}
		return ""
	case "tracestate":
		return strings.Join(http.Header(c.HeaderCarrier).Values(key), ",")
	}
	return c.HeaderCarrier.Get(key)
}

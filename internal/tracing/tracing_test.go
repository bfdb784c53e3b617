package tracing

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

func env(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

func TestDecide(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want exporterKind
		err  string
	}{
		{"nothing configured", nil, exportNone, ""},
		{"endpoint", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, exportOTLP, ""},
		{"traces endpoint", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4318/v1/traces"}, exportOTLP, ""},
		{"otlp without endpoint uses the exporter's default", map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, exportOTLP, ""},
		{"exporter none beats an endpoint", map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, exportNone, ""},
		{"none anywhere in the list", map[string]string{"OTEL_TRACES_EXPORTER": "otlp, none"}, exportNone, ""},
		{"console", map[string]string{"OTEL_TRACES_EXPORTER": "Console"}, exportConsole, ""},
		{"sdk disabled beats everything", map[string]string{"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, exportNone, ""},
		{"sdk disabled false", map[string]string{"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, exportOTLP, ""},
		{"http/protobuf", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, exportOTLP, ""},
		{"grpc refused", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, 0, "not supported"},
		{"traces protocol wins", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, exportOTLP, ""},
		{"protocol irrelevant when off", map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, exportNone, ""},
		{"unknown exporter", map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, 0, "want otlp, console or none"},
		{"two exporters", map[string]string{"OTEL_TRACES_EXPORTER": "otlp,console"}, 0, "only one exporter"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, err := decide(env(c.env))
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err = %v, want one containing %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d.exporter != c.want {
				t.Fatalf("exporter = %v (%s), want %v", d.exporter, d.reason, c.want)
			}
		})
	}
}

// A process with tracing off still passes an incoming trace and its baggage
// on: a no-op span carries its parent's span context, sampled flag included.
func TestOffPassesContextThrough(t *testing.T) {
	tel, err := setup(context.Background(), "orders", nil, env(nil), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := tel.TracerProvider.(noop.TracerProvider); !ok {
		t.Fatalf("provider = %T, want a no-op provider", tel.TracerProvider)
	}
	for _, tp := range []string{
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
	} {
		in := propagation.MapCarrier{"traceparent": tp, "tracestate": "vendor=x", "baggage": "tenant=acme"}
		ctx := tel.Propagator.Extract(context.Background(), in)
		ctx, span := tel.TracerProvider.Tracer("t").Start(ctx, "write")
		if span.IsRecording() {
			t.Fatal("a no-op span records")
		}
		out := propagation.MapCarrier{}
		tel.Propagator.Inject(ctx, out)
		span.End()
		if out["traceparent"] != tp || out["tracestate"] != "vendor=x" || out["baggage"] != "tenant=acme" {
			t.Fatalf("out = %v, want the incoming headers unchanged", out)
		}
	}
	// Nothing incoming: nothing invented.
	ctx, span := tel.TracerProvider.Tracer("t").Start(context.Background(), "write")
	out := propagation.MapCarrier{}
	tel.Propagator.Inject(ctx, out)
	span.End()
	if len(out) != 0 {
		t.Fatalf("out = %v, want nothing without an incoming context", out)
	}
	if err := tel.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// otlpSink counts OTLP/HTTP export requests.
type otlpSink struct {
	mu       sync.Mutex
	requests int
	paths    []string
	ctypes   []string
	headers  []string
}

func (s *otlpSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	s.mu.Lock()
	s.requests++
	s.paths = append(s.paths, r.URL.Path)
	s.ctypes = append(s.ctypes, r.Header.Get("Content-Type"))
	s.headers = append(s.headers, r.Header.Get("X-Tenant"))
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/x-protobuf")
	w.WriteHeader(http.StatusOK)
}

func TestOTLPExportFromEndpoint(t *testing.T) {
	sink := &otlpSink{}
	srv := httptest.NewServer(sink)
	defer srv.Close()
	vars := map[string]string{
		"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL,
		"OTEL_EXPORTER_OTLP_HEADERS":  "x-tenant=acme",
		"OTEL_SERVICE_NAME":           "orders-eu",
		"OTEL_TRACES_SAMPLER":         "always_on",
	}
	for k, v := range vars {
		t.Setenv(k, v)
	}
	tel, err := setup(context.Background(), "orders", nil, env(vars), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	_, span := tel.TracerProvider.Tracer("t").Start(context.Background(), "write")
	if !span.IsRecording() || !span.SpanContext().IsSampled() {
		t.Fatal("span not recorded or not sampled with an endpoint set")
	}
	span.End()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := tel.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if sink.requests != 1 || sink.paths[0] != "/v1/traces" || sink.ctypes[0] != "application/x-protobuf" || sink.headers[0] != "acme" {
		t.Fatalf("requests=%d paths=%v content types=%v headers=%v, want one protobuf POST to /v1/traces with the configured header",
			sink.requests, sink.paths, sink.ctypes, sink.headers)
	}
}

func TestSamplerFromEnv(t *testing.T) {
	t.Setenv("OTEL_TRACES_SAMPLER", "parentbased_always_off")
	vars := map[string]string{"OTEL_TRACES_EXPORTER": "console"}
	var buf bytes.Buffer
	tel, err := setup(context.Background(), "orders", nil, env(vars), &buf)
	if err != nil {
		t.Fatal(err)
	}
	_, span := tel.TracerProvider.Tracer("t").Start(context.Background(), "root")
	if span.SpanContext().IsSampled() {
		t.Fatal("parentbased_always_off sampled a root span: the SDK did not read OTEL_TRACES_SAMPLER")
	}
	span.End()
	// A sampled parent is still followed.
	parent := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled, Remote: true,
	})
	_, child := tel.TracerProvider.Tracer("t").Start(trace.ContextWithRemoteSpanContext(context.Background(), parent), "child")
	if !child.SpanContext().IsSampled() {
		t.Fatal("a sampled parent's child was not sampled")
	}
	child.End()
	if err := tel.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(buf.String(), "\n"); n != 1 {
		t.Fatalf("console wrote %d spans, want 1 (the child): %s", n, buf.String())
	}
}

func TestConsoleExporter(t *testing.T) {
	t.Setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test")
	vars := map[string]string{"OTEL_TRACES_EXPORTER": "console"}
	var buf bytes.Buffer
	tel, err := setup(context.Background(), "shipping", nil, env(vars), &buf)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := baggage.NewMember("tenant", "acme")
	b, _ := baggage.New(m)
	ctx := baggage.ContextWithBaggage(context.Background(), b)
	ctx, parent := tel.TracerProvider.Tracer("t").Start(ctx, "parent", trace.WithSpanKind(trace.SpanKindServer))
	_, child := tel.TracerProvider.Tracer("t").Start(ctx, "child")
	child.End()
	parent.End()
	if err := tel.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	var spans []consoleSpan
	dec := json.NewDecoder(&buf)
	for dec.More() {
		var s consoleSpan
		if err := dec.Decode(&s); err != nil {
			t.Fatal(err)
		}
		spans = append(spans, s)
	}
	if len(spans) != 2 || spans[0].Name != "child" || spans[1].Name != "parent" ||
		spans[0].ParentID != spans[1].SpanID || spans[0].TraceID != spans[1].TraceID ||
		spans[1].Kind != "server" || spans[0].Service != "shipping" {
		t.Fatalf("spans = %+v", spans)
	}
}

func TestSetupRefusesBadConfig(t *testing.T) {
	for _, vars := range []map[string]string{
		{"OTEL_TRACES_EXPORTER": "jaeger"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
	} {
		if tel, err := setup(context.Background(), "orders", nil, env(vars), io.Discard); err == nil {
			_ = tel.Shutdown(context.Background())
			t.Fatalf("%v: no error", vars)
		}
	}
}

func TestDisabled(t *testing.T) {
	tel := Disabled()
	if tel.Shutdown == nil || tel.Propagator == nil || tel.TracerProvider == nil {
		t.Fatal("Disabled left a field nil")
	}
	fields := tel.Propagator.Fields()
	want := map[string]bool{"traceparent": true, "tracestate": true, "baggage": true}
	if len(fields) != len(want) {
		t.Fatalf("fields = %v", fields)
	}
	for _, f := range fields {
		if !want[f] {
			t.Fatalf("fields = %v", fields)
		}
	}
}

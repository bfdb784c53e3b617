package tracing

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime/debug"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
)

func env(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

// setEnv clears every variable setup reads, then sets vars, for the test.
// setup reads the process environment, as the SDK's packages do.
func setEnv(t *testing.T, vars map[string]string) {
	t.Helper()
	for _, k := range []string{
		"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_HEADERS",
		"OTEL_EXPORTER_OTLP_INSECURE", "OTEL_PROPAGATORS", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES",
		"OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
	} {
		t.Setenv(k, "")
	}
	for k, v := range vars {
		t.Setenv(k, v)
	}
}

func TestDecide(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want exporterKind
		err  string
	}{
		{"nothing configured", nil, exportNone, ""},
		{"endpoint", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, exportAuto, ""},
		{"traces endpoint", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4318/v1/traces"}, exportAuto, ""},
		{"otlp without endpoint uses the exporter's default", map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, exportAuto, ""},
		{"exporter none beats an endpoint", map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, exportNone, ""},
		{"none anywhere in the list", map[string]string{"OTEL_TRACES_EXPORTER": "otlp, none"}, exportNone, ""},
		{"console", map[string]string{"OTEL_TRACES_EXPORTER": "Console"}, exportConsole, ""},
		{"sdk disabled beats everything", map[string]string{"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, exportNone, ""},
		{"sdk disabled false", map[string]string{"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}, exportAuto, ""},
		{"grpc", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, exportAuto, ""},
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
	setEnv(t, nil)
	tel, err := setup(context.Background(), "orders", nil, io.Discard)
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

// traceOne sets up tracing from the environment (console spans to
// console), records one sampled span named name, and flushes it.
func traceOne(t *testing.T, console io.Writer, name string) {
	t.Helper()
	tel, err := setup(context.Background(), "orders", nil, console)
	if err != nil {
		t.Fatal(err)
	}
	_, span := tel.TracerProvider.Tracer("t").Start(context.Background(), name)
	if !span.IsRecording() || !span.SpanContext().IsSampled() {
		t.Fatal("span not recorded or not sampled with an exporter set")
	}
	span.End()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := tel.Shutdown(ctx); err != nil {
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
	setEnv(t, map[string]string{
		"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL,
		"OTEL_EXPORTER_OTLP_HEADERS":  "x-tenant=acme",
		"OTEL_SERVICE_NAME":           "orders-eu",
		"OTEL_TRACES_SAMPLER":         "always_on",
	})
	traceOne(t, io.Discard, "write")
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if sink.requests != 1 || sink.paths[0] != "/v1/traces" || sink.ctypes[0] != "application/x-protobuf" || sink.headers[0] != "acme" {
		t.Fatalf("requests=%d paths=%v content types=%v headers=%v, want one protobuf POST to /v1/traces with the configured header",
			sink.requests, sink.paths, sink.ctypes, sink.headers)
	}
}

// grpcSink is an OTLP/gRPC trace receiver.
type grpcSink struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	names []string
}

func (s *grpcSink) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				s.names = append(s.names, sp.GetName())
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

// OTEL_EXPORTER_OTLP_PROTOCOL=grpc exports over gRPC (autoexport), which the
// hand-written setup refused.
func TestOTLPExportOverGRPC(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	sink := &grpcSink{}
	coltracepb.RegisterTraceServiceServer(srv, sink)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	setEnv(t, map[string]string{
		"OTEL_EXPORTER_OTLP_ENDPOINT": "http://" + ln.Addr().String(),
		"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
		"OTEL_EXPORTER_OTLP_INSECURE": "true",
	})
	traceOne(t, io.Discard, "over grpc")
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if len(sink.names) != 1 || sink.names[0] != "over grpc" {
		t.Fatalf("the gRPC receiver got spans %v, want [over grpc]", sink.names)
	}
}

// OTEL_PROPAGATORS is honoured (autoprop), with tracing on or off; an
// unknown propagator is refused at start.
func TestPropagatorsFromEnv(t *testing.T) {
	const traceID, spanID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	for _, vars := range []map[string]string{
		{"OTEL_PROPAGATORS": "b3multi, baggage"},
		{"OTEL_PROPAGATORS": "b3multi,baggage", "OTEL_TRACES_EXPORTER": "console"},
	} {
		setEnv(t, vars)
		tel, err := setup(context.Background(), "orders", nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		in := propagation.HeaderCarrier{}
		in.Set("X-B3-TraceId", traceID)
		in.Set("X-B3-SpanId", spanID)
		in.Set("X-B3-Sampled", "1")
		in.Set("Baggage", "tenant=acme")
		ctx := tel.Propagator.Extract(context.Background(), in)
		if sc := trace.SpanContextFromContext(ctx); sc.TraceID().String() != traceID || !sc.IsSampled() {
			t.Fatalf("%v: extracted %v from B3 headers", vars, sc)
		}
		ctx, span := tel.TracerProvider.Tracer("t").Start(ctx, "child")
		out := propagation.HeaderCarrier{}
		tel.Propagator.Inject(ctx, out)
		span.End()
		if out.Get("X-B3-TraceId") != traceID || out.Get("Traceparent") != "" || out.Get("Baggage") != "tenant=acme" {
			t.Fatalf("%v: injected %v, want B3 headers and the baggage, no traceparent", vars, out)
		}
		_ = tel.Shutdown(context.Background())
	}
	setEnv(t, map[string]string{"OTEL_PROPAGATORS": "tracecontext,smoke-signals"})
	if _, err := setup(context.Background(), "orders", nil, io.Discard); err == nil || !strings.Contains(err.Error(), "OTEL_PROPAGATORS") {
		t.Fatalf("an unknown propagator: err %v, want one naming OTEL_PROPAGATORS", err)
	}
}

// consoleSpan is the part of stdouttrace's JSON the tests read.
type consoleSpan struct {
	Name        string
	SpanKind    int
	SpanContext struct{ TraceID, SpanID string }
	Parent      struct{ TraceID, SpanID string }
	Resource    []struct {
		Key   string
		Value struct{ Value any }
	}
}

func (s consoleSpan) resource(key string) string {
	for _, kv := range s.Resource {
		if kv.Key == key {
			v, _ := kv.Value.Value.(string)
			return v
		}
	}
	return ""
}

func readConsole(t *testing.T, buf *bytes.Buffer) []consoleSpan {
	t.Helper()
	var spans []consoleSpan
	dec := json.NewDecoder(buf)
	for dec.More() {
		var s consoleSpan
		if err := dec.Decode(&s); err != nil {
			t.Fatal(err)
		}
		spans = append(spans, s)
	}
	return spans
}

func TestSamplerFromEnv(t *testing.T) {
	setEnv(t, map[string]string{"OTEL_TRACES_SAMPLER": "parentbased_always_off", "OTEL_TRACES_EXPORTER": "console"})
	var buf bytes.Buffer
	tel, err := setup(context.Background(), "orders", nil, &buf)
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
	if spans := readConsole(t, &buf); len(spans) != 1 || spans[0].Name != "child" {
		t.Fatalf("console wrote %+v, want the child alone", spans)
	}
}

// OTEL_TRACES_EXPORTER=console is the SDK's stdout exporter, on the writer
// given (stderr: stdout carries the logs), with the service's resource.
func TestConsoleExporter(t *testing.T) {
	setEnv(t, map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test"})
	var buf bytes.Buffer
	tel, err := setup(context.Background(), "shipping", nil, &buf)
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
	spans := readConsole(t, &buf)
	if len(spans) != 2 || spans[0].Name != "child" || spans[1].Name != "parent" ||
		spans[0].Parent.SpanID != spans[1].SpanContext.SpanID || spans[0].SpanContext.TraceID != spans[1].SpanContext.TraceID ||
		spans[1].SpanKind != int(trace.SpanKindServer) || spans[0].resource("service.name") != "shipping" ||
		spans[0].resource("deployment.environment.name") != "test" {
		t.Fatalf("spans = %+v", spans)
	}
}

// Each process has its own service.instance.id, so that two relays of one
// service are told apart, unless OTEL_RESOURCE_ATTRIBUTES names one.
func TestServiceInstanceID(t *testing.T) {
	ids := map[string]bool{}
	for range 2 {
		setEnv(t, map[string]string{"OTEL_TRACES_EXPORTER": "console"})
		var buf bytes.Buffer
		traceOne(t, &buf, "publish")
		id := readConsole(t, &buf)[0].resource("service.instance.id")
		if _, err := uuid.Parse(id); err != nil {
			t.Fatalf("service.instance.id %q is not a UUID: %v", id, err)
		}
		ids[id] = true
	}
	if len(ids) != 2 {
		t.Fatalf("two processes got the same service.instance.id: %v", ids)
	}
	setEnv(t, map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=relay-7"})
	var buf bytes.Buffer
	traceOne(t, &buf, "publish")
	if id := readConsole(t, &buf)[0].resource("service.instance.id"); id != "relay-7" {
		t.Fatalf("service.instance.id %q, want OTEL_RESOURCE_ATTRIBUTES' relay-7", id)
	}
}

func TestSetupRefusesBadConfig(t *testing.T) {
	for _, vars := range []map[string]string{
		{"OTEL_TRACES_EXPORTER": "jaeger"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"},
		{"OTEL_PROPAGATORS": "smoke-signals"},
	} {
		setEnv(t, vars)
		if tel, err := setup(context.Background(), "orders", nil, io.Discard); err == nil {
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

// The resource carries service.version, the binary's (Version), unless
// OTEL_RESOURCE_ATTRIBUTES names one.
func TestServiceVersion(t *testing.T) {
	setEnv(t, map[string]string{"OTEL_TRACES_EXPORTER": "console"})
	var buf bytes.Buffer
	traceOne(t, &buf, "publish")
	if got := readConsole(t, &buf)[0].resource("service.version"); got == "" || got != Version() {
		t.Fatalf("service.version %q, want the binary's %q", got, Version())
	}
	setEnv(t, map[string]string{"OTEL_TRACES_EXPORTER": "console", "OTEL_RESOURCE_ATTRIBUTES": "service.version=1.2.3"})
	buf.Reset()
	traceOne(t, &buf, "publish")
	if got := readConsole(t, &buf)[0].resource("service.version"); got != "1.2.3" {
		t.Fatalf("service.version %q, want OTEL_RESOURCE_ATTRIBUTES' 1.2.3", got)
	}
}

// Version reads the build information: the module's version, else the VCS
// revision, else "devel".
func TestVersionFromBuildInfo(t *testing.T) {
	vcs := func(rev, modified string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}
	}
	const rev = "0123456789abcdef0123456789abcdef01234567"
	for _, c := range []struct {
		info *debug.BuildInfo
		want string
	}{
		{&debug.BuildInfo{Main: debug.Module{Version: "v1.4.0"}, Settings: vcs(rev, "false")}, "v1.4.0"},
		{&debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20260101120000-0123456789ab+dirty"}}, "v0.0.0-20260101120000-0123456789ab+dirty"},
		{&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: vcs(rev, "false")}, "0123456789ab"},
		{&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: vcs(rev, "true")}, "0123456789ab-dirty"},
		{&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "devel"},
		{nil, "devel"},
	} {
		got := version(func() (*debug.BuildInfo, bool) { return c.info, c.info != nil })
		if got != c.want {
			t.Errorf("build info %+v: version %q, want %q", c.info, got, c.want)
		}
	}
}

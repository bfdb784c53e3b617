package deploy_test

import (
	"net/url"
	"strings"
	"testing"
)

// Every application exports its spans over OTLP/HTTP to the Jaeger service,
// under its own service name, with nothing but the standard OTEL_*
// variables; Jaeger accepts OTLP on the port they use and serves its UI.
func TestTracingExportsToJaeger(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	j := service(t, p, "jaeger")
	if !strings.HasPrefix(j.Image, "jaegertracing/all-in-one:") {
		t.Errorf("jaeger image %q, want jaegertracing/all-in-one", j.Image)
	}
	if env(t, j, "COLLECTOR_OTLP_ENABLED") != "true" {
		t.Error("jaeger: COLLECTOR_OTLP_ENABLED must be true to accept OTLP")
	}
	names := map[string]bool{}
	for _, name := range apps {
		s := service(t, p, name)
		u, err := url.Parse(env(t, s, "OTEL_EXPORTER_OTLP_ENDPOINT"))
		if err != nil {
			t.Fatalf("%s OTEL_EXPORTER_OTLP_ENDPOINT: %v", name, err)
		}
		if u.Scheme != "http" || u.Hostname() != "jaeger" || u.Port() != "4318" || (u.Path != "" && u.Path != "/") {
			t.Errorf("%s OTEL_EXPORTER_OTLP_ENDPOINT %s: want http://jaeger:4318 (OTLP/HTTP; the exporter appends /v1/traces)", name, u)
		}
		if !exposes(j, "4318") {
			t.Errorf("jaeger does not expose 4318, where %s exports", name)
		}
		if p, ok := s.Environment["OTEL_EXPORTER_OTLP_PROTOCOL"]; ok && p != nil && *p != "http/protobuf" {
			t.Errorf("%s OTEL_EXPORTER_OTLP_PROTOCOL %q: port 4318 is OTLP over http/protobuf (grpc is 4317)", name, *p)
		}
		n := env(t, s, "OTEL_SERVICE_NAME")
		if names[n] {
			t.Errorf("%s: OTEL_SERVICE_NAME %q is used twice: traces could not tell the processes apart", name, n)
		}
		names[n] = true
		if _, ok := s.DependsOn["jaeger"]; ok {
			t.Errorf("%s waits for jaeger: tracing must not hold an application back", name)
		}
	}
	if !exposes(j, "16686") {
		t.Error("jaeger does not publish its UI (16686)")
	}
}

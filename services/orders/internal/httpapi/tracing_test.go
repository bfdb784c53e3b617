package httpapi_test

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// One POST /orders gives a server span and, under it, the write span; the
// event stores the write span's context (not the client's header) and the
// client's baggage. Probes get no span.
func TestCreateTracesServerAndWriteSpans(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	b := setupTraced(t, sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	const client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	c := b.do(t, "POST", "/orders", "application/json", validBody,
		"Traceparent", client, "Tracestate", "vendor=x", "Baggage", "tenant=acme,session=s1")
	if c.status != http.StatusCreated {
		t.Fatalf("create: %d %s", c.status, c.raw)
	}
	b.do(t, "GET", "/healthz", "", "")
	spans := exp.GetSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans (%v), want the write span and the server span", len(spans), spans)
	}
	write, server := spans[0], spans[1]
	if server.Name != "POST /orders" || server.SpanKind != trace.SpanKindServer ||
		server.Parent.SpanID().String() != "00f067aa0ba902b7" || server.SpanContext.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("server span %q kind %v parent %v", server.Name, server.SpanKind, server.Parent)
	}
	if write.Name != "orders.create" || write.Parent.SpanID() != server.SpanContext.SpanID() {
		t.Fatalf("write span %q parent %v, want a child of the server span", write.Name, write.Parent)
	}
	route := ""
	for _, kv := range server.Attributes {
		if kv.Key == "http.route" {
			route = kv.Value.AsString()
		}
	}
	if route != "/orders" {
		t.Errorf("http.route %q", route)
	}
	h := storedHeaders(t, b, c.body["id"].(string))[0]
	want := "00-" + write.SpanContext.TraceID().String() + "-" + write.SpanContext.SpanID().String() + "-01"
	// Baggage is a set: its members come in no particular order.
	if h["traceparent"] != want || h["tracestate"] != "vendor=x" || !sameMembers(h["baggage"], "tenant=acme,session=s1") {
		t.Fatalf("stored %v, want traceparent %s, the tracestate and the baggage", h, want)
	}
}

// An unsampled request records nothing, and its event still carries the
// trace, unsampled, and the baggage.
func TestUnsampledRequestRecordsNothing(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	b := setupTraced(t, sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.AlwaysSample()))))
	c := b.do(t, "POST", "/orders", "application/json", validBody,
		"Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", "Baggage", "tenant=acme")
	if c.status != http.StatusCreated {
		t.Fatalf("create: %d %s", c.status, c.raw)
	}
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("%d spans recorded for an unsampled request", n)
	}
	h := storedHeaders(t, b, c.body["id"].(string))[0]
	tp := h["traceparent"]
	if !validTraceparent(tp) || tp[3:35] != "4bf92f3577b34da6a3ce929d0e0e4736" || tp[53:] != "00" || h["baggage"] != "tenant=acme" {
		t.Fatalf("stored %v, want the client's trace, unsampled, and its baggage", h)
	}
}

// Tracing off and no client context: nothing is invented.
func TestNoTraceContextStoresNone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.do(t, "POST", "/orders", "application/json", validBody)
	if c.status != http.StatusCreated {
		t.Fatalf("create: %d %s", c.status, c.raw)
	}
	if h := storedHeaders(t, b, c.body["id"].(string))[0]; len(h) != 0 {
		t.Fatalf("stored %v, want no headers", h)
	}
}

// sameMembers says the comma-separated lists a and b hold the same members.
func sameMembers(a, b string) bool {
	x, y := strings.Split(a, ","), strings.Split(b, ",")
	slices.Sort(x)
	slices.Sort(y)
	return slices.Equal(x, y)
}

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

// One POST /orders gives a server span, under it the write span, and under
// that the event's PRODUCER create span; the event stores the create span's
// context (not the client's header) and the client's baggage. Probes get
// no span.
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
	if len(spans) != 3 {
		t.Fatalf("%d spans (%v), want the create, write and server spans", len(spans), spans)
	}
	create, write, server := spans[0], spans[1], spans[2]
	if server.Name != "POST /orders" || server.SpanKind != trace.SpanKindServer ||
		server.Parent.SpanID().String() != "00f067aa0ba902b7" || server.SpanContext.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("server span %q kind %v parent %v", server.Name, server.SpanKind, server.Parent)
	}
	if write.Name != "orders.create" || write.Parent.SpanID() != server.SpanContext.SpanID() || write.SpanKind != trace.SpanKindInternal {
		t.Fatalf("write span %q kind %v parent %v, want an internal child of the server span", write.Name, write.SpanKind, write.Parent)
	}
	if create.Name != "create orders.events" || create.Parent.SpanID() != write.SpanContext.SpanID() || create.SpanKind != trace.SpanKindProducer {
		t.Fatalf("create span %q kind %v parent %v, want a producer child of the write span", create.Name, create.SpanKind, create.Parent)
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
	want := "00-" + create.SpanContext.TraceID().String() + "-" + create.SpanContext.SpanID().String() + "-01"
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

// An untrusted caller does not set the trace: with tracing on, its request
// is the root of a trace of its own, linked to the context it sent, and its
// baggage is not stored; with tracing off, nothing of its headers is.
func TestUntrustedCallersContextIsNotBelieved(t *testing.T) {
	t.Parallel()
	const client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	untrusted := func(*http.Request) bool { return false }

	exp := tracetest.NewInMemoryExporter()
	b := setupTrusting(t, sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)), untrusted)
	c := b.do(t, "POST", "/orders", "application/json", validBody, "Traceparent", client, "Baggage", "tenant=acme")
	if c.status != http.StatusCreated {
		t.Fatalf("create: %d %s", c.status, c.raw)
	}
	var server tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		if s.SpanKind == trace.SpanKindServer {
			server = s
		}
	}
	if server.Parent.IsValid() || server.SpanContext.TraceID().String() == client[3:35] ||
		len(server.Links) != 1 || server.Links[0].SpanContext.SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("server span in trace %s, parent %v, links %v: want a new root linked to the caller's span", server.SpanContext.TraceID(), server.Parent, server.Links)
	}
	h := storedHeaders(t, b, c.body["id"].(string))[0]
	if _, ok := h["baggage"]; ok || !strings.Contains(h["traceparent"], server.SpanContext.TraceID().String()) {
		t.Fatalf("stored %v: want the new trace and no baggage", h)
	}

	off := setupTrusting(t, nil, untrusted)
	c = off.do(t, "POST", "/orders", "application/json", validBody, "Traceparent", client, "Baggage", "tenant=acme")
	if h := storedHeaders(t, off, c.body["id"].(string))[0]; len(h) != 0 {
		t.Fatalf("tracing off: stored %v from an untrusted caller, want nothing", h)
	}
}

package httpapi

import (
	"context"
	"net/http"
	"testing"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

const (
	testTraceID  = "4bf92f3577b34da6a3ce929d0e0e4736"
	testParentID = "00f067aa0ba902b7"
	testParent   = "00-" + testTraceID + "-" + testParentID + "-01"
)

// The request's headers are read as the W3C specification says, where
// OpenTelemetry's HeaderCarrier would take the first field of each.
func TestRequestPropagatorReadsFieldsPerSpecification(t *testing.T) {
	t.Parallel()
	prop := requestPropagator{propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})}
	extract := func(h http.Header) trace.SpanContext {
		return trace.SpanContextFromContext(prop.Extract(context.Background(), propagation.HeaderCarrier(h)))
	}
	h := http.Header{}
	h.Add("Traceparent", testParent)
	h.Add("Tracestate", "a=1")
	h.Add("Tracestate", "b=2")
	sc := extract(h)
	if sc.TraceID().String() != testTraceID || sc.TraceState().String() != "a=1,b=2" {
		t.Fatalf("two tracestate fields: %v %q, want one list", sc.TraceID(), sc.TraceState().String())
	}
	h.Add("Traceparent", testParent)
	if sc := extract(h); sc.IsValid() {
		t.Fatalf("two traceparent fields were accepted: %v", sc)
	}
}

package outboxotel_test

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxotel"
)

const (
	traceID   = "4bf92f3577b34da6a3ce929d0e0e4736"
	parentID  = "00f067aa0ba902b7"
	sampled   = "00-" + traceID + "-" + parentID + "-01"
	unsampled = "00-" + traceID + "-" + parentID + "-00"
)

// recorder is an inner publisher that keeps what it was handed and fails the
// envelopes named in fail.
type recorder struct {
	mu   sync.Mutex
	got  [][]outbox.Envelope
	fail map[int64]error
}

func (r *recorder) WaitReady(ctx context.Context) error { return ctx.Err() }

func (r *recorder) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, msgs)
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		errs[i] = r.fail[m.ID]
	}
	return errs
}

// amqpLike also names its exchange and routing keys, as outboxamqp does.
type amqpLike struct{ recorder }

func (*amqpLike) Exchange() string                    { return "orders.events" }
func (*amqpLike) RoutingKey(e outbox.Envelope) string { return "rk." + e.EventType }

func newProvider(sampler sdktrace.Sampler) (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	exp := tracetest.NewInMemoryExporter()
	return sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sampler)), exp
}

func envelope(id int64, headers map[string]string) outbox.Envelope {
	return outbox.Envelope{
		ID: id, AggregateType: "order", AggregateID: "o-1", AggregateVersion: 3,
		EventType: "order.created", Payload: []byte(`{"a":1}`), Headers: headers, Attempt: 1,
	}
}

func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

func TestPublishSpanIsAChildOfTheStoredContext(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	inner := &amqpLike{}
	pub := outboxotel.NewPublisher(inner, outboxotel.Config{TracerProvider: tp})
	stored := map[string]string{
		"traceparent": sampled, "tracestate": "vendor=x", "baggage": "tenant=acme", "other": "kept",
	}
	original := maps.Clone(stored)
	errs := pub.PublishBatch(context.Background(), []outbox.Envelope{envelope(42, stored)})
	if len(errs) != 1 || errs[0] != nil {
		t.Fatalf("errs = %v", errs)
	}
	if !maps.Equal(stored, original) {
		t.Fatalf("the stored headers were changed: %v", stored)
	}
	spans := exp.GetSpans()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	s := spans[0]
	if s.Name != "publish orders.events" || s.SpanKind != trace.SpanKindProducer {
		t.Fatalf("span %q kind %v", s.Name, s.SpanKind)
	}
	if s.Parent.TraceID().String() != traceID || s.Parent.SpanID().String() != parentID || !s.Parent.IsRemote() {
		t.Fatalf("parent %v, want the stored context", s.Parent)
	}
	if s.SpanContext.TraceID().String() != traceID || s.SpanContext.TraceState().String() != "vendor=x" {
		t.Fatalf("span context %v", s.SpanContext)
	}
	a := attrs(s)
	for k, want := range map[attribute.Key]any{
		"messaging.system":                           "rabbitmq",
		"messaging.operation.type":                   "send",
		"messaging.operation.name":                   "publish",
		"messaging.destination.name":                 "orders.events",
		"messaging.message.id":                       "42",
		"messaging.rabbitmq.destination.routing_key": "rk.order.created",
		"messaging.message.body.size":                int64(7),
		"outbox.aggregate.type":                      "order",
		"outbox.aggregate.id":                        "o-1",
		"outbox.aggregate.version":                   int64(3),
		"outbox.event.type":                          "order.created",
		"outbox.attempt":                             int64(1),
	} {
		if got := a[k].AsInterface(); got != want {
			t.Errorf("%s = %v (%T), want %v", k, got, got, want)
		}
	}
	if s.Status.Code != codes.Unset {
		t.Errorf("status %v", s.Status)
	}
	sent := inner.got[0][0].Headers
	wantTP := "00-" + traceID + "-" + s.SpanContext.SpanID().String() + "-01"
	if sent["traceparent"] != wantTP || sent["tracestate"] != "vendor=x" || sent["baggage"] != "tenant=acme" || sent["other"] != "kept" {
		t.Fatalf("sent headers %v, want traceparent %s and the rest kept", sent, wantTP)
	}
}

// An unsampled context records nothing, but what goes out still names the
// trace, unsampled, with its baggage.
func TestUnsampledStaysUnsampled(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	inner := &recorder{}
	pub := outboxotel.NewPublisher(inner, outboxotel.Config{TracerProvider: tp, Destination: func(outbox.Envelope) string { return "x" }})
	pub.PublishBatch(context.Background(), []outbox.Envelope{envelope(1, map[string]string{"traceparent": unsampled, "baggage": "tenant=acme"})})
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("%d spans recorded for an unsampled context", n)
	}
	sent := inner.got[0][0].Headers
	if !strings.HasPrefix(sent["traceparent"], "00-"+traceID+"-") || !strings.HasSuffix(sent["traceparent"], "-00") || sent["baggage"] != "tenant=acme" {
		t.Fatalf("sent %v, want the same trace, unsampled, and the baggage", sent)
	}
}

// Each envelope's span ends with its own outcome; a retry of the same row is
// another span in the same trace, under the same stored parent.
func TestOutcomesAndRetries(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.AlwaysSample())
	boom := errors.New("nacked")
	inner := &recorder{fail: map[int64]error{2: boom}}
	pub := outboxotel.NewPublisher(inner, outboxotel.Config{TracerProvider: tp})
	h := map[string]string{"traceparent": sampled}
	errs := pub.PublishBatch(context.Background(), []outbox.Envelope{envelope(1, h), envelope(2, h)})
	if errs[0] != nil || !errors.Is(errs[1], boom) {
		t.Fatalf("errs %v: the inner publisher's must come back unchanged", errs)
	}
	retry := envelope(2, h)
	retry.Attempt = 2
	inner.fail = nil
	pub.PublishBatch(context.Background(), []outbox.Envelope{retry})
	spans := exp.GetSpans()
	if len(spans) != 3 {
		t.Fatalf("%d spans, want 3", len(spans))
	}
	byID := map[string][]tracetest.SpanStub{}
	for _, s := range spans {
		if s.SpanContext.TraceID().String() != traceID || s.Parent.SpanID().String() != parentID {
			t.Fatalf("span %s not under the stored context: %v", s.Name, s.Parent)
		}
		byID[attrs(s)["messaging.message.id"].AsString()] = append(byID[attrs(s)["messaging.message.id"].AsString()], s)
	}
	if s := byID["1"][0]; s.Status.Code != codes.Unset {
		t.Errorf("message 1: status %v", s.Status)
	}
	first, second := byID["2"][0], byID["2"][1]
	if first.Status.Code != codes.Error || first.Status.Description != "nacked" || len(first.Events) != 1 || first.Events[0].Name != "exception" {
		t.Errorf("failed attempt: status %v events %v", first.Status, first.Events)
	}
	if second.Status.Code != codes.Unset || attrs(second)["outbox.attempt"].AsInt64() != 2 {
		t.Errorf("retry: status %v attempt %v", second.Status, attrs(second)["outbox.attempt"])
	}
	if first.Name != "publish" {
		t.Errorf("name without a destination: %q", first.Name)
	}
}

// Without a stored context the publish starts a trace of its own.
func TestNoStoredContextStartsATrace(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.AlwaysSample())
	inner := &recorder{}
	pub := outboxotel.NewPublisher(inner, outboxotel.Config{TracerProvider: tp})
	pub.PublishBatch(context.Background(), []outbox.Envelope{envelope(1, map[string]string{})})
	spans := exp.GetSpans()
	if len(spans) != 1 || spans[0].Parent.IsValid() {
		t.Fatalf("spans %v, want one root span", spans)
	}
	want := "00-" + spans[0].SpanContext.TraceID().String() + "-" + spans[0].SpanContext.SpanID().String() + "-01"
	if got := inner.got[0][0].Headers["traceparent"]; got != want {
		t.Fatalf("traceparent %q, want %q", got, want)
	}
	if _, ok := inner.got[0][0].Headers["baggage"]; ok {
		t.Fatal("a baggage header without baggage")
	}
}

// The context the relay runs with is not the event's: a span or baggage on
// it (a caller that started the relay inside a span, with baggage) must not
// become the parent or the baggage of an event stored without a context.
func TestRelayContextIsNotTheEventsContext(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.AlwaysSample())
	inner := &recorder{}
	pub := outboxotel.NewPublisher(inner, outboxotel.Config{TracerProvider: tp})
	ctx, runSpan := tp.Tracer("test").Start(context.Background(), "relay run")
	member, err := baggage.NewMember("operator", "alice")
	if err != nil {
		t.Fatal(err)
	}
	b, err := baggage.New(member)
	if err != nil {
		t.Fatal(err)
	}
	ctx = baggage.ContextWithBaggage(ctx, b)
	pub.PublishBatch(ctx, []outbox.Envelope{envelope(1, map[string]string{}), envelope(2, map[string]string{"traceparent": sampled})})
	runSpan.End()
	for _, s := range exp.GetSpans() {
		if s.Name == "relay run" {
			continue
		}
		if s.Parent.SpanID() == runSpan.SpanContext().SpanID() {
			t.Errorf("publish span %s is a child of the relay's own span", s.Name)
		}
	}
	for _, m := range inner.got[0] {
		if got, ok := m.Headers["baggage"]; ok {
			t.Errorf("event %d went out with the relay's baggage %q", m.ID, got)
		}
	}
}

// Tracing off: the batch passes through as it is, without allocating.
func TestNoopPassesThrough(t *testing.T) {
	inner := &recorder{}
	for _, cfg := range []outboxotel.Config{{}, {TracerProvider: noop.NewTracerProvider()}} {
		pub := outboxotel.NewPublisher(inner, cfg)
		msgs := []outbox.Envelope{envelope(1, map[string]string{"traceparent": sampled, "baggage": "a=1"})}
		pub.PublishBatch(context.Background(), msgs)
		got := inner.got[len(inner.got)-1]
		if &got[0] != &msgs[0] {
			t.Fatal("the batch was copied with tracing off")
		}
	}
	nop := outboxotel.NewPublisher(nopPublisher{}, outboxotel.Config{TracerProvider: noop.NewTracerProvider()})
	msgs := []outbox.Envelope{envelope(1, map[string]string{"traceparent": sampled})}
	if n := testing.AllocsPerRun(100, func() { nop.PublishBatch(context.Background(), msgs) }); n != 0 {
		t.Fatalf("%v allocations per batch with tracing off", n)
	}
}

type nopPublisher struct{}

func (nopPublisher) WaitReady(context.Context) error                         { return nil }
func (nopPublisher) PublishBatch(context.Context, []outbox.Envelope) []error { return nil }

func TestInjectHeaders(t *testing.T) {
	t.Parallel()
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	if h := outboxotel.InjectHeaders(context.Background(), prop, nil); h != nil {
		t.Fatalf("nothing to inject: %v, want nil", h)
	}
	tp, _ := newProvider(sdktrace.AlwaysSample())
	m, _ := baggage.NewMember("tenant", "acme")
	b, _ := baggage.New(m)
	ctx, span := tp.Tracer("t").Start(baggage.ContextWithBaggage(context.Background(), b), "write")
	defer span.End()
	h := outboxotel.InjectHeaders(ctx, nil, nil)
	want := "00-" + span.SpanContext().TraceID().String() + "-" + span.SpanContext().SpanID().String() + "-01"
	if h["traceparent"] != want || h["baggage"] != "tenant=acme" {
		t.Fatalf("headers %v", h)
	}
	existing := map[string]string{"x": "y"}
	if got := outboxotel.InjectHeaders(ctx, prop, existing); got["x"] != "y" || got["traceparent"] != want {
		t.Fatalf("into existing headers: %v", got)
	}
	back := trace.SpanContextFromContext(outboxotel.Extract(context.Background(), nil, h))
	if back.SpanID() != span.SpanContext().SpanID() || !back.IsRemote() {
		t.Fatalf("Extract: %v", back)
	}
	if keys := slices.Sorted(maps.Keys(h)); len(keys) != 2 {
		t.Fatalf("keys %v", keys)
	}
}

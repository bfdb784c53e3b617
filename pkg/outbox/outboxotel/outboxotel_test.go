package outboxotel_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

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
		CreatedAt: now.Add(-time.Second),
	}
}

func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// outboxID is the outbox id of the message s published, in decimal, read
// from its message id.
func outboxID(s tracetest.SpanStub) string {
	id, _, _ := outbox.ParseMessageID(attrs(s)["messaging.message.id"].AsString())
	return strconv.FormatInt(id, 10)
}

// now is the tests' clock; envelopes are written a second before it.
var now = time.Date(2026, 11, 29, 22, 0, 1, 0, time.UTC)

func clock() time.Time { return now }

func newPublisher(inner outbox.Publisher, tp trace.TracerProvider) *outboxotel.Publisher {
	return outboxotel.NewPublisher(inner, outboxotel.Config{TracerProvider: tp, Now: clock})
}

// A young event's publish span is a PRODUCER child of the creation context
// stored with it, and links to it; what goes to the broker is the stored
// headers, unchanged: the creation context, which the consumer links to.
func TestPublishSpanIsAChildOfAYoungCreationContextAndLinksToIt(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	inner := &amqpLike{}
	pub := newPublisher(inner, tp)
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
	if sent := inner.got[0][0].Headers; !maps.Equal(sent, original) {
		t.Fatalf("sent headers %v, want the stored ones unchanged (the creation context)", sent)
	}
	spans := exp.GetSpans()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1", len(spans))
	}
	s := spans[0]
	// A create span exists (its context is stored): the send span is CLIENT.
	if s.Name != "publish orders.events" || s.SpanKind != trace.SpanKindClient {
		t.Fatalf("span %q kind %v, want client", s.Name, s.SpanKind)
	}
	if s.Parent.TraceID().String() != traceID || s.Parent.SpanID().String() != parentID || !s.Parent.IsRemote() {
		t.Fatalf("parent %v, want the stored context", s.Parent)
	}
	if len(s.Links) != 1 || s.Links[0].SpanContext.SpanID().String() != parentID || s.Links[0].SpanContext.TraceID().String() != traceID {
		t.Fatalf("links %v, want one to the creation context", s.Links)
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
		"messaging.message.id":                       envelope(42, nil).MessageID(),
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
	if _, ok := a["error.type"]; ok || s.Status.Code != codes.Unset {
		t.Errorf("a confirmed publish: status %v, error.type %v", s.Status, a["error.type"])
	}
}

// An event that waited longer than ParentMaxAge (a broker outage) is
// published in a trace of its own, linked to its creation, instead of
// stretching the creation's trace over the wait; ParentMaxAge negative
// always does so.
func TestOldEventIsPublishedInATraceOfItsOwnLinkedToItsCreation(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		maxAge time.Duration
		age    time.Duration
	}{{0, time.Hour}, {10 * time.Minute, 11 * time.Minute}, {-1, 0}} {
		tp, exp := newProvider(sdktrace.ParentBased(sdktrace.AlwaysSample()))
		pub := outboxotel.NewPublisher(&amqpLike{}, outboxotel.Config{TracerProvider: tp, Now: clock, ParentMaxAge: c.maxAge})
		m := envelope(7, map[string]string{"traceparent": sampled})
		m.CreatedAt = now.Add(-c.age)
		pub.PublishBatch(context.Background(), []outbox.Envelope{m})
		spans := exp.GetSpans()
		if len(spans) != 1 {
			t.Fatalf("max age %v, age %v: %d spans", c.maxAge, c.age, len(spans))
		}
		s := spans[0]
		if s.Parent.IsValid() || s.SpanContext.TraceID().String() == traceID {
			t.Errorf("max age %v, age %v: span in trace %s under %v, want a root of a new trace", c.maxAge, c.age, s.SpanContext.TraceID(), s.Parent)
		}
		if len(s.Links) != 1 || s.Links[0].SpanContext.SpanID().String() != parentID {
			t.Errorf("max age %v, age %v: links %v, want one to the creation context", c.maxAge, c.age, s.Links)
		}
		if s.SpanKind != trace.SpanKindClient {
			t.Errorf("max age %v, age %v: kind %v, want client (a create span exists)", c.maxAge, c.age, s.SpanKind)
		}
	}
}

// An unsampled creation context records nothing: no publish span at all,
// whatever the event's age, and the message goes out as stored.
func TestUnsampledStaysUnsampled(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.ParentBased(sdktrace.AlwaysSample()))
	inner := &recorder{}
	pub := outboxotel.NewPublisher(inner, outboxotel.Config{TracerProvider: tp, Now: clock, Destination: func(outbox.Envelope) string { return "x" }})
	stored := map[string]string{"traceparent": unsampled, "baggage": "tenant=acme"}
	old := envelope(2, stored)
	old.CreatedAt = now.Add(-time.Hour)
	pub.PublishBatch(context.Background(), []outbox.Envelope{envelope(1, stored), old})
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("%d spans recorded for an unsampled context", n)
	}
	if sent := inner.got[0][0].Headers; !maps.Equal(sent, stored) {
		t.Fatalf("sent %v, want the stored headers", sent)
	}
}

// Each envelope's span ends with its own outcome, a failure with its
// error.type; a retry of the same row is another span, under the same
// creation context.
func TestOutcomesAndRetries(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.AlwaysSample())
	boom := errors.New("nacked")
	inner := &recorder{fail: map[int64]error{
		2: boom,
		3: fmt.Errorf("returned: %w", outbox.ErrUnroutable),
		4: fmt.Errorf("not connected: %w", outbox.ErrNotSent),
		5: fmt.Errorf("no confirm: %w", context.DeadlineExceeded),
	}}
	pub := newPublisher(inner, tp)
	h := map[string]string{"traceparent": sampled}
	batch := []outbox.Envelope{envelope(1, h), envelope(2, h), envelope(3, h), envelope(4, h), envelope(5, h)}
	errs := pub.PublishBatch(context.Background(), batch)
	if errs[0] != nil || !errors.Is(errs[1], boom) || !errors.Is(errs[2], outbox.ErrUnroutable) {
		t.Fatalf("errs %v: the inner publisher's must come back unchanged", errs)
	}
	retry := envelope(2, h)
	retry.Attempt = 2
	inner.fail = nil
	pub.PublishBatch(context.Background(), []outbox.Envelope{retry})
	spans := exp.GetSpans()
	if len(spans) != 6 {
		t.Fatalf("%d spans, want 6", len(spans))
	}
	byID := map[string][]tracetest.SpanStub{}
	for _, s := range spans {
		if s.SpanContext.TraceID().String() != traceID || s.Parent.SpanID().String() != parentID {
			t.Fatalf("span %s not under the creation context: %v", s.Name, s.Parent)
		}
		id := outboxID(s)
		byID[id] = append(byID[id], s)
	}
	if s := byID["1"][0]; s.Status.Code != codes.Unset {
		t.Errorf("message 1: status %v", s.Status)
	}
	for id, want := range map[string]string{"2": "_OTHER", "3": "unroutable", "4": "not_sent", "5": "timeout"} {
		s := byID[id][0]
		if s.Status.Code != codes.Error || len(s.Events) != 1 || s.Events[0].Name != "exception" || attrs(s)["error.type"].AsString() != want {
			t.Errorf("message %s: status %v events %v error.type %q, want Error, an exception and %q", id, s.Status, s.Events, attrs(s)["error.type"].AsString(), want)
		}
	}
	if first := byID["2"][0]; first.Status.Description != "nacked" || first.Name != "publish" {
		t.Errorf("failed attempt: status %v, name %q", first.Status, first.Name)
	}
	if second := byID["2"][1]; second.Status.Code != codes.Unset || attrs(second)["outbox.attempt"].AsInt64() != 2 {
		t.Errorf("retry: status %v attempt %v", second.Status, attrs(second)["outbox.attempt"])
	}
}

// timedNode confirms each message at a time of its own and names its node,
// as outboxamqp.Publisher does.
type timedNode struct {
	recorder
	at []time.Time
}

func (p *timedNode) PublishBatchTimed(ctx context.Context, msgs []outbox.Envelope, confirmed []time.Time) []error {
	copy(confirmed, p.at)
	return p.PublishBatch(ctx, msgs)
}

func (*timedNode) Node() (string, int) { return "rabbit-2.example", 5671 }

// Each publish span ends at its own message's confirm, not at the end of
// the batch; a message without a confirm ends with the batch. The node
// connected to is server.address and server.port.
func TestEachSpanEndsAtItsOwnConfirm(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.AlwaysSample())
	base := time.Now().Add(-time.Minute)
	inner := &timedNode{at: []time.Time{base.Add(10 * time.Millisecond), base.Add(30 * time.Millisecond), {}}}
	pub := newPublisher(inner, tp)
	h := map[string]string{"traceparent": sampled}
	before := time.Now()
	pub.PublishBatch(context.Background(), []outbox.Envelope{envelope(1, h), envelope(2, h), envelope(3, h)})
	ends := map[string]time.Time{}
	for _, s := range exp.GetSpans() {
		ends[outboxID(s)] = s.EndTime
		if a := attrs(s); a["server.address"].AsString() != "rabbit-2.example" || a["server.port"].AsInt64() != 5671 {
			t.Errorf("span %s: server.address %v, server.port %v", s.Name, a["server.address"], a["server.port"])
		}
	}
	if !ends["1"].Equal(inner.at[0]) || !ends["2"].Equal(inner.at[1]) {
		t.Errorf("spans end at %v and %v, want their confirms %v and %v", ends["1"], ends["2"], inner.at[0], inner.at[1])
	}
	if ends["3"].Before(before) {
		t.Errorf("the unconfirmed message's span ends at %v, before the batch (%v)", ends["3"], before)
	}
}

// Without a stored context the publish starts a trace of its own, with no
// link, and the message goes out without one.
func TestNoStoredContextStartsATrace(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.AlwaysSample())
	inner := &recorder{}
	pub := newPublisher(inner, tp)
	pub.PublishBatch(context.Background(), []outbox.Envelope{envelope(1, map[string]string{})})
	spans := exp.GetSpans()
	if len(spans) != 1 || spans[0].Parent.IsValid() || len(spans[0].Links) != 0 {
		t.Fatalf("spans %v, want one root span without links", spans)
	}
	// No create span: the send span is the message's PRODUCER span.
	if spans[0].SpanKind != trace.SpanKindProducer {
		t.Fatalf("span kind %v, want producer", spans[0].SpanKind)
	}
	if h := inner.got[0][0].Headers; len(h) != 0 {
		t.Fatalf("headers %v, want none", h)
	}
}

// The context the relay runs with is not the event's: a span or baggage on
// it (a caller that started the relay inside a span, with baggage) must not
// become the parent of an event's publish, nor reach the broker.
func TestRelayContextIsNotTheEventsContext(t *testing.T) {
	t.Parallel()
	tp, exp := newProvider(sdktrace.AlwaysSample())
	inner := &recorder{}
	pub := newPublisher(inner, tp)
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

// Only the allowed keys of the baggage are stored, within the size limit.
func TestLimitBaggage(t *testing.T) {
	t.Parallel()
	prop := propagation.Baggage{}
	ctx := prop.Extract(context.Background(), propagation.MapCarrier{"baggage": "tenant=acme,session=s1,secret=hunter2,region=eu-west-1"})
	for _, c := range []struct {
		keys []string
		max  int
		want string
	}{
		{[]string{"tenant", "region"}, 0, "tenant=acme,region=eu-west-1"},
		{[]string{"tenant", "region"}, len("tenant=acme"), "tenant=acme"},
		{[]string{"region", "tenant"}, len("tenant=acme"), "tenant=acme"}, // region does not fit, tenant does
		{[]string{"absent"}, 0, ""},
		{nil, 0, ""},
	} {
		got := baggage.FromContext(outboxotel.LimitBaggage(ctx, c.keys, c.max))
		want, err := baggage.Parse(c.want)
		if err != nil {
			t.Fatal(err)
		}
		if got.Len() != want.Len() {
			t.Errorf("keys %v, max %d: %q, want %q", c.keys, c.max, got.String(), c.want)
			continue
		}
		for _, m := range want.Members() {
			if got.Member(m.Key()).Value() != m.Value() {
				t.Errorf("keys %v, max %d: %q, want %q", c.keys, c.max, got.String(), c.want)
			}
		}
		if c.max > 0 && len(got.String()) > c.max {
			t.Errorf("keys %v: %d bytes, over %d", c.keys, len(got.String()), c.max)
		}
	}
	if h := outboxotel.InjectHeaders(outboxotel.LimitBaggage(ctx, nil, 0), nil, nil); h != nil {
		t.Errorf("no key allowed, no span: headers %v, want none", h)
	}
}

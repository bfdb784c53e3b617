package app_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/processor"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// A trace the relay's publish span would have sent.
const (
	traceID      = "4bf92f3577b34da6a3ce929d0e0e4736"
	parentSpanID = "00f067aa0ba902b7"
)

func traceparent(flags string) string { return "00-" + traceID + "-" + parentSpanID + "-" + flags }

// traced is a service instance with an in-memory span recorder, and what its
// handler's context carried into Store.Apply.
type traced struct {
	app  *app.App
	rec  *tracetest.SpanRecorder
	seen *contextLog
}

// contextLog records, per order, the span context and the baggage the
// effect's context carried.
type contextLog struct {
	mu  sync.Mutex
	sc  map[string]trace.SpanContext
	bag map[string]baggage.Baggage
}

func (l *contextLog) get(orderID string) (trace.SpanContext, baggage.Baggage) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sc[orderID], l.bag[orderID]
}

type contextLoggingStore struct {
	processor.Store
	l *contextLog
}

func (s contextLoggingStore) Apply(ctx context.Context, msgID string, ev shipment.Event) (shipment.Outcome, error) {
	s.l.mu.Lock()
	s.l.sc[ev.OrderID] = trace.SpanContextFromContext(ctx)
	s.l.bag[ev.OrderID] = baggage.FromContext(ctx)
	s.l.mu.Unlock()
	return s.Store.Apply(ctx, msgID, ev)
}

func startTraced(t *testing.T, e *env, sampler sdktrace.Sampler, cfg app.Config) *traced {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sampler))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	l := &contextLog{sc: map[string]trace.SpanContext{}, bag: map[string]baggage.Baggage{}}
	cfg.TracerProvider = tp
	cfg.Propagator = tracing.Propagator()
	wrap := cfg.WrapStore
	cfg.WrapStore = func(s processor.Store) processor.Store {
		if wrap != nil {
			s = wrap(s)
		}
		return contextLoggingStore{s, l}
	}
	return &traced{app: e.start(cfg), rec: rec, seen: l}
}

// processSpans returns the ended process spans (CONSUMER) of message msgID,
// in start order.
func (tr *traced) processSpans(msgID string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range tr.rec.Ended() {
		if s.SpanKind() == trace.SpanKindConsumer && attrOf(s, "messaging.message.id").AsString() == msgID {
			out = append(out, s)
		}
	}
	return out
}

// waitProcessSpans waits until msgID has n ended process spans.
func (tr *traced) waitProcessSpans(t *testing.T, msgID string, n int) []sdktrace.ReadOnlySpan {
	t.Helper()
	var spans []sdktrace.ReadOnlySpan
	waitFor(t, 60*time.Second, fmt.Sprintf("%d process spans of message %s", n, msgID), func() bool {
		spans = tr.processSpans(msgID)
		return len(spans) >= n
	})
	return spans
}

// children returns the names of the ended children of span, in start
// order, and the children by name.
func (tr *traced) children(span sdktrace.ReadOnlySpan) ([]string, map[string]sdktrace.ReadOnlySpan) {
	var names []string
	by := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range tr.rec.Ended() {
		if s.Parent().SpanID() == span.SpanContext().SpanID() && s.SpanContext().TraceID() == span.SpanContext().TraceID() {
			names = append(names, s.Name())
			by[s.Name()] = s
		}
	}
	return names, by
}

func attrOf(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

func wantAttrs(t *testing.T, s sdktrace.ReadOnlySpan, want map[string]any) {
	t.Helper()
	for k, v := range want {
		if got := attrOf(s, k).AsInterface(); fmt.Sprint(got) != fmt.Sprint(v) {
			t.Errorf("span %q: %s = %v, want %v", s.Name(), k, got, v)
		}
	}
}

func TestTraceContinuesFromTheHeadersThroughTheInboxAndADuplicateStaysInIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tr := startTraced(t, e, sdktrace.ParentBased(sdktrace.AlwaysSample()), app.Config{})
	queue := tr.app.Topology().Queue

	ev := created("tr-1", "order-tr-1")
	ev.Headers = amqp.Table{"traceparent": traceparent("01"), "baggage": "tenant=acme"}
	e.pub.publish(ev)
	e.waitShipment("order-tr-1", 1)
	first := tr.waitProcessSpans(t, "tr-1", 1)[0]

	if got := first.SpanContext().TraceID().String(); got != traceID {
		t.Fatalf("process span in trace %s, want %s", got, traceID)
	}
	if got := first.Parent().SpanID().String(); got != parentSpanID || !first.Parent().IsRemote() {
		t.Fatalf("process span's parent %s (remote %v), want the traceparent's span %s", got, first.Parent().IsRemote(), parentSpanID)
	}
	if first.SpanKind() != trace.SpanKindConsumer || first.Name() != "process orders.events" {
		t.Fatalf("process span %q kind %v, want consumer, named after its destination orders.events", first.Name(), first.SpanKind())
	}
	if l := first.Links(); len(l) != 1 || l[0].SpanContext.SpanID().String() != parentSpanID {
		t.Fatalf("process span links %v, want one to the context the message carries", l)
	}
	if attrOf(first, "server.address").AsString() == "" || attrOf(first, "server.port").AsInt64() == 0 {
		t.Errorf("process span without server.address and server.port")
	}
	wantAttrs(t, first, map[string]any{
		"messaging.system":                           "rabbitmq",
		"messaging.operation.type":                   "process",
		"messaging.destination.name":                 "orders.events",
		"messaging.destination.subscription.name":    queue,
		"messaging.rabbitmq.destination.routing_key": shipment.TypeCreated,
		"messaging.message.id":                       "tr-1",
		"shipping.redelivered":                       false,
		"outbox.aggregate.type":                      "order",
		"outbox.aggregate.id":                        "order-tr-1",
		"outbox.aggregate.version":                   1,
		"outbox.event.type":                          shipment.TypeCreated,
		"shipping.attempt":                           1,
		"inbox.duplicate":                            false,
		"shipping.verdict":                           "ack",
	})
	if attrOf(first, "messaging.rabbitmq.message.delivery_tag").AsInt64() < 1 {
		t.Error("process span without a delivery tag")
	}
	names, kids := tr.children(first)
	if got, want := strings.Join(names, ", "), "inbox check, apply shipment, inbox record, ack "+queue; got != want {
		t.Fatalf("children of the process span: %s; want %s", got, want)
	}
	wantAttrs(t, kids["apply shipment"], map[string]any{"shipping.outcome": "applied"})
	wantAttrs(t, kids["inbox check"], map[string]any{"inbox.duplicate": false})
	if kids["ack "+queue].SpanKind() != trace.SpanKindClient {
		t.Errorf("ack span kind %v, want client", kids["ack "+queue].SpanKind())
	}
	wantAttrs(t, kids["ack "+queue], map[string]any{
		"messaging.operation.type": "settle", "messaging.destination.name": "orders.events",
		"messaging.destination.subscription.name": queue, "messaging.message.id": "tr-1",
	})
	sc, bag := tr.seen.get("order-tr-1")
	if sc.SpanID() != kids["apply shipment"].SpanContext().SpanID() {
		t.Errorf("the effect ran in span %s, not in its apply span", sc.SpanID())
	}
	if v := bag.Member("tenant").Value(); v != "acme" {
		t.Errorf("baggage in the effect's context: %q, want tenant=acme", bag.String())
	}

	// The same message again (a relay that published twice): a second
	// process span in the same trace, a duplicate, without an effect.
	e.pub.publish(ev)
	spans := tr.waitProcessSpans(t, "tr-1", 2)
	second := spans[1]
	if second.SpanContext().TraceID().String() != traceID || second.Parent().SpanID().String() != parentSpanID {
		t.Fatalf("the duplicate's process span is in trace %s under %s, want the original's", second.SpanContext().TraceID(), second.Parent().SpanID())
	}
	wantAttrs(t, second, map[string]any{"inbox.duplicate": true, "shipping.verdict": "ack"})
	names, kids = tr.children(second)
	if got, want := strings.Join(names, ", "), "inbox check, ack "+queue; got != want {
		t.Fatalf("children of the duplicate's process span: %s; want %s", got, want)
	}
	wantAttrs(t, kids["inbox check"], map[string]any{"inbox.duplicate": true, "inbox.cached": true})
	if n := dupInbox(tr.app); n != 1 {
		t.Fatalf("inbox duplicates %v, want 1", n)
	}
}

func TestMessageWithoutTraceHeadersStartsANewTrace(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tr := startTraced(t, e, sdktrace.ParentBased(sdktrace.AlwaysSample()), app.Config{})
	e.pub.publish(created("tr-root", "order-tr-root"))
	span := tr.waitProcessSpans(t, "tr-root", 1)[0]
	if span.Parent().IsValid() {
		t.Fatalf("process span of a message without headers has parent %v, want none (a root)", span.Parent())
	}
	if !span.SpanContext().IsSampled() || span.SpanContext().TraceID().String() == traceID {
		t.Fatalf("root process span %v", span.SpanContext())
	}
	if names, _ := tr.children(span); len(names) != 4 {
		t.Fatalf("children %v, want the check, the effect, the record and the ack", names)
	}

	// The HTTP API: a server span per request, none for the probes.
	base := "http://" + tr.app.HTTPAddr()
	if status, _, _ := get(t, base+"/healthz"); status != 200 {
		t.Fatalf("/healthz: %d", status)
	}
	if status, _, _ := get(t, base+"/shipments/order-tr-root"); status != 200 {
		t.Fatalf("GET shipment: %d", status)
	}
	var server []string
	waitFor(t, 10*time.Second, "the server span ended", func() bool {
		server = nil
		for _, s := range tr.rec.Ended() {
			if s.SpanKind() == trace.SpanKindServer {
				server = append(server, s.Name()+" "+attrOf(s, "url.path").AsString())
			}
		}
		return len(server) > 0
	})
	if got := strings.Join(server, ", "); got != "GET /shipments/order-tr-root" {
		t.Fatalf("server spans %q, want one for the shipment's GET", got)
	}
}

func TestUnsampledTraceRecordsNothingButItsContextAndBaggageTravel(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tr := startTraced(t, e, sdktrace.ParentBased(sdktrace.AlwaysSample()), app.Config{})
	top := tr.app.Topology()

	ev := created("tr-u1", "order-tr-u1")
	ev.Headers = amqp.Table{"traceparent": traceparent("00"), "baggage": "tenant=acme"}
	e.pub.publish(ev)
	poison := created("tr-u2", "order-tr-u2")
	poison.Body = []byte(`{"order_id": `)
	poison.Headers = ev.Headers
	e.pub.publish(poison)

	e.waitShipment("order-tr-u1", 1)
	var dead []amqp.Delivery
	waitFor(t, 30*time.Second, "the poison message dead-lettered", func() bool {
		dead = append(dead, e.deadLetters(top.DeadLetterQueue)...)
		return len(dead) > 0
	})
	e.waitDrained(tr.app)
	if n := len(tr.rec.Started()); n != 0 {
		t.Fatalf("%d spans recorded for an unsampled trace, want none", n)
	}
	sc, bag := tr.seen.get("order-tr-u1")
	if sc.TraceID().String() != traceID || sc.IsSampled() {
		t.Fatalf("the effect's context: %v, want trace %s, unsampled", sc, traceID)
	}
	if v := bag.Member("tenant").Value(); v != "acme" {
		t.Fatalf("baggage in the effect's context: %q, want tenant=acme", bag.String())
	}
	tp, _ := dead[0].Headers["traceparent"].(string)
	if p := strings.Split(tp, "-"); len(p) != 4 || p[1] != traceID || p[3] != "00" {
		t.Fatalf("dead-lettered copy's traceparent %q: want trace %s, unsampled", tp, traceID)
	}
	if b, _ := dead[0].Headers["baggage"].(string); b != "tenant=acme" {
		t.Fatalf("dead-lettered copy's baggage %q, want tenant=acme", b)
	}
}

func TestDeferredAndDeadLetteredCopiesStayInTheOriginalTrace(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tr := startTraced(t, e, sdktrace.ParentBased(sdktrace.AlwaysSample()), app.Config{})
	top := tr.app.Topology()
	headers := amqp.Table{"traceparent": traceparent("01"), "baggage": "tenant=acme"}

	// A cancel before its create is deferred through the delay queue until
	// the create came.
	cancel := cancelled("tr-d2", "order-tr-d")
	cancel.Headers = headers
	e.pub.publish(cancel)
	tr.waitProcessSpans(t, "tr-d2", 2) // deferred at least once, and back
	create := created("tr-d1", "order-tr-d")
	create.Headers = headers
	e.pub.publish(create)
	e.waitShipment("order-tr-d", 2)
	// A poison message is dead-lettered.
	poison := created("tr-p", "order-tr-p")
	poison.Body = []byte(`{"order_id": `)
	poison.Headers = headers
	e.pub.publish(poison)
	var dead []amqp.Delivery
	waitFor(t, 30*time.Second, "the poison message dead-lettered", func() bool {
		dead = append(dead, e.deadLetters(top.DeadLetterQueue)...)
		return len(dead) > 0
	})
	e.waitDrained(tr.app)

	spans := tr.processSpans("tr-d2")
	byID := map[trace.SpanID]sdktrace.ReadOnlySpan{}
	for _, s := range tr.rec.Ended() {
		byID[s.SpanContext().SpanID()] = s
	}
	for i, s := range spans {
		if s.SpanContext().TraceID().String() != traceID {
			t.Fatalf("process span %d of the deferred message in trace %s, want %s", i, s.SpanContext().TraceID(), traceID)
		}
		if i == 0 {
			wantAttrs(t, s, map[string]any{"shipping.verdict": "defer", "shipping.verdict.reason": "gap"})
			continue
		}
		// Back from the delay queue: its parent is the previous handling's
		// publish span, a PRODUCER child of that process span.
		pub, ok := byID[s.Parent().SpanID()]
		if !ok || pub.Name() != "publish "+top.DelayQueue || pub.SpanKind() != trace.SpanKindProducer || pub.Parent().SpanID() != spans[i-1].SpanContext().SpanID() {
			t.Fatalf("process span %d of the deferred message: parent %v, want the defer's publish span under process span %d", i, s.Parent().SpanID(), i-1)
		}
		wantAttrs(t, pub, map[string]any{
			"messaging.operation.type": "send", "messaging.destination.name": "",
			"messaging.rabbitmq.destination.routing_key": top.DelayQueue, "messaging.message.id": "tr-d2",
		})
	}
	if last := spans[len(spans)-1]; attrOf(last, "shipping.deferrals").AsInt64() != int64(len(spans)-1) {
		t.Errorf("last process span: shipping.deferrals %v, want %d", attrOf(last, "shipping.deferrals").AsInt64(), len(spans)-1)
	}

	// The dead-lettered copy's traceparent is its publish span's, in the
	// original trace, sampled, with the baggage.
	tp, _ := dead[0].Headers["traceparent"].(string)
	p := strings.Split(tp, "-")
	if len(p) != 4 || p[1] != traceID || p[3] != "01" {
		t.Fatalf("dead-lettered copy's traceparent %q: want trace %s, sampled", tp, traceID)
	}
	pub, ok := byID[mustSpanID(t, p[2])]
	if !ok || pub.Name() != "publish "+top.DeadLetterExchange || pub.SpanKind() != trace.SpanKindProducer {
		t.Fatalf("dead-lettered copy's parent span %s: not the dead letter's publish span", p[2])
	}
	process := byID[pub.Parent().SpanID()]
	if process == nil || process.Name() != "process orders.events" || process.Status().Code != codes.Error {
		t.Fatalf("the dead letter's publish span is not under an errored process span")
	}
	wantAttrs(t, process, map[string]any{"shipping.verdict": "dead_letter", "shipping.verdict.reason": "malformed_payload", "error.type": "malformed_payload"})
	if b, _ := dead[0].Headers["baggage"].(string); b != "tenant=acme" {
		t.Fatalf("dead-lettered copy's baggage %q, want tenant=acme", b)
	}
}

func mustSpanID(t *testing.T, s string) trace.SpanID {
	t.Helper()
	id, err := trace.SpanIDFromHex(s)
	if err != nil {
		t.Fatalf("span id %q: %v", s, err)
	}
	return id
}

// An event that waited longer than ParentMaxAge (its outbox_created_at) is
// processed in a trace of its own, linked to the context it carries, so a
// broker outage does not stretch the order's trace over the wait; a young
// one is that context's child, linked to it too.
func TestOldEventIsProcessedInATraceOfItsOwn(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tr := startTraced(t, e, sdktrace.ParentBased(sdktrace.AlwaysSample()), app.Config{})

	old := created("tr-old", "order-tr-old")
	old.Headers = amqp.Table{"traceparent": traceparent("01"), "outbox_created_at": time.Now().Add(-time.Hour).UTC().Format(time.RFC3339Nano)}
	e.pub.publish(old)
	young := created("tr-young", "order-tr-young")
	young.Headers = amqp.Table{"traceparent": traceparent("01"), "outbox_created_at": time.Now().UTC().Format(time.RFC3339Nano)}
	e.pub.publish(young)

	o := tr.waitProcessSpans(t, "tr-old", 1)[0]
	if o.Parent().IsValid() || o.SpanContext().TraceID().String() == traceID {
		t.Errorf("old event: process span in trace %s under %v, want the root of a new trace", o.SpanContext().TraceID(), o.Parent())
	}
	if l := o.Links(); len(l) != 1 || l[0].SpanContext.TraceID().String() != traceID || l[0].SpanContext.SpanID().String() != parentSpanID {
		t.Errorf("old event: links %v, want one to the context it carries", l)
	}
	if names, _ := tr.children(o); !strings.Contains(strings.Join(names, ","), "apply shipment") {
		t.Errorf("old event: the effect is not in the process span's trace: children %v", names)
	}
	y := tr.waitProcessSpans(t, "tr-young", 1)[0]
	if y.Parent().SpanID().String() != parentSpanID || y.SpanContext().TraceID().String() != traceID || len(y.Links()) != 1 {
		t.Errorf("young event: process span under %v in trace %s with links %v, want a child of the carried context, linked to it", y.Parent(), y.SpanContext().TraceID(), y.Links())
	}
}

// With DatabaseSpans (TRACE_DB=true) the MongoDB commands of a delivery are
// CLIENT spans under its process span's children; without, there are none.
func TestDatabaseSpansAreOptional(t *testing.T) {
	t.Parallel()
	for _, on := range []bool{true, false} {
		e := newEnv(t)
		tr := startTraced(t, e, sdktrace.ParentBased(sdktrace.AlwaysSample()), app.Config{DatabaseSpans: on})
		id := fmt.Sprintf("tr-db-%v", on)
		ev := created(id, "order-"+id)
		ev.Headers = amqp.Table{"traceparent": traceparent("01")}
		e.pub.publish(ev)
		process := tr.waitProcessSpans(t, id, 1)[0]
		var commands []string
		for _, s := range tr.rec.Ended() {
			if s.SpanKind() == trace.SpanKindClient && s.SpanContext().TraceID() == process.SpanContext().TraceID() &&
				attrOf(s, "db.system.name").AsString() == "mongodb" {
				commands = append(commands, s.Name())
			}
		}
		if on && len(commands) == 0 {
			t.Errorf("DatabaseSpans: no MongoDB command span in the delivery's trace")
		}
		if !on && len(commands) != 0 {
			t.Errorf("no DatabaseSpans: MongoDB command spans %v", commands)
		}
	}
}

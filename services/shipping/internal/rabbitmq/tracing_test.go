package rabbitmq

import (
	"context"
	"errors"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
	"log/slog"
	"maps"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
)

// With tracing off (a no-op provider) a delivery's spans cost nothing: no
// span is started and nothing is allocated; only the trace headers are read,
// when there are any.
func TestNoopTracingAllocatesNothingPerDelivery(t *testing.T) {
	tr := newTracing(noop.NewTracerProvider(), nil, "q", 0)
	if tr.on {
		t.Fatal("tracing on with a no-op provider")
	}
	d := &amqp.Delivery{MessageId: "m-1", Exchange: "orders.events", RoutingKey: "order.created", DeliveryTag: 7}
	ctx := context.Background()
	allocs := testing.AllocsPerRun(200, func() {
		dctx := tr.extract(ctx, d)
		hctx, span := tr.startProcess(dctx, d, 0, nil)
		endSpan(tr.startAck(hctx, d), nil)
		endProcess(span, shipment.Verdict{Action: shipment.Ack}, nil)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per delivery with tracing off, want 0", allocs)
	}
}

// With tracing off the delivery's trace context still reaches the handler.
func TestNoopTracingStillExtractsTheDeliverysContext(t *testing.T) {
	tr := newTracing(noop.NewTracerProvider(), nil, "q", 0)
	d := &amqp.Delivery{Headers: amqp.Table{HeaderTraceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"}}
	hctx, span := tr.startProcess(tr.extract(context.Background(), d), d, 0, nil)
	if span != nil {
		t.Fatal("a span with tracing off")
	}
	sc := trace.SpanContextFromContext(hctx)
	if sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || sc.IsSampled() {
		t.Fatalf("handler's span context %v", sc)
	}
	msg := amqp.Publishing{Headers: amqp.Table{HeaderTraceparent: "stale", HeaderTracestate: "stale=1"}}
	_, pspan := tr.startPublish(hctx, "", "q.delay", "gap", &msg)
	if pspan != nil {
		t.Fatal("a publish span with tracing off")
	}
	if got := msg.Headers[HeaderTraceparent]; got != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00" {
		t.Fatalf("copy's traceparent %v, want the delivery's", got)
	}
	if _, ok := msg.Headers[HeaderTracestate]; ok {
		t.Fatal("a stale tracestate survived in the copy")
	}
}

// A CloudEvents event whose producer set only the distributed tracing
// extension reaches the handler in its creation context; a traceparent
// header, the transport's, wins over it (a copy republished by shipping
// carries its own span's there). The event's age comes from its time
// attribute.
func TestCloudEventsTracingExtensionIsTheContextWithoutATraceHeader(t *testing.T) {
	tr := newTracing(noop.NewTracerProvider(), nil, "q", 0)
	const created = "4bf92f3577b34da6a3ce929d0e0e4736"
	d := &amqp.Delivery{Headers: amqp.Table{
		"cloudEvents_traceparent": "00-" + created + "-00f067aa0ba902b7-01",
		"cloudEvents_tracestate":  "congo=t61rcWkgMzE",
	}}
	sc := trace.SpanContextFromContext(tr.extract(context.Background(), d))
	if sc.TraceID().String() != created || sc.TraceState().Get("congo") != "t61rcWkgMzE" {
		t.Fatalf("context %v, want the extension's", sc)
	}
	if _, ok := d.Headers[HeaderTraceparent]; ok {
		t.Fatal("extract changed the delivery's headers")
	}
	d.Headers[HeaderTraceparent] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	if sc := trace.SpanContextFromContext(tr.extract(context.Background(), d)); sc.TraceID().String() != "0af7651916cd43dd8448eb211c80319c" {
		t.Fatalf("context %v, want the traceparent header's", sc)
	}

	tr.parentMaxAge = time.Minute
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	tr.now = func() time.Time { return now }
	for at, want := range map[string]bool{"2026-12-01T11:59:30Z": true, "2026-12-01T11:58:00Z": false} {
		d := &amqp.Delivery{Headers: amqp.Table{"cloudEvents_time": at}}
		if got := tr.young(d); got != want {
			t.Errorf("created %s, now %s: young %v, want %v", at, now.Format(time.RFC3339), got, want)
		}
	}
}

// spanAttr returns the attribute k of s.
func spanAttr(s sdktrace.ReadOnlySpan, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// On the real broker: a republished copy the broker returns (no queue for
// it) and an ack on a channel that closed end their spans as errors with
// error.type; the ack span names the exchange the delivery came through
// (messaging.destination.name); spans that succeed carry no error.type.
func TestFailedRepublishAndAckSpansCarryErrorType(t *testing.T) {
	_, url := amqptest.VHost(t)
	conn, ch := channel(t, url)
	defer conn.Close()
	const queue = "traced"
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, queue, "amq.direct", false, nil); err != nil {
		t.Fatal(err)
	}
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tr := newTracing(tp, nil, queue, 0)
	ctx, process := tp.Tracer("test").Start(t.Context(), "process")
	defer process.End()

	nodes, err := amqpaddr.New(url)
	if err != nil {
		t.Fatal(err)
	}
	pub := &republisher{nodes: nodes, name: "tracing-test", inFlight: 4, log: slog.New(slog.DiscardHandler)}
	defer pub.close()
	if err := republish(ctx, &tr, pub, "", "no-such-queue", "gap", amqp.Publishing{MessageId: "m-lost"}); !errors.Is(err, ErrReturned) {
		t.Fatalf("republish to a missing queue: %v, want it returned", err)
	}
	if err := republish(ctx, &tr, pub, "amq.direct", queue, "gap", amqp.Publishing{MessageId: "m-1"}); err != nil {
		t.Fatalf("republish: %v", err)
	}

	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var d amqp.Delivery
	select {
	case d = <-deliveries:
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery")
	}
	if err := ack(ctx, &tr, &d); err != nil {
		t.Fatalf("ack: %v", err)
	}
	if err := ch.Publish("amq.direct", queue, false, false, amqp.Publishing{MessageId: "m-2"}); err != nil {
		t.Fatal(err)
	}
	select {
	case d = <-deliveries:
	case <-time.After(30 * time.Second):
		t.Fatal("no second delivery")
	}
	if err := ch.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ack(ctx, &tr, &d); !errors.Is(err, amqp.ErrClosed) {
		t.Fatalf("ack on a closed channel: %v, want amqp.ErrClosed", err)
	}

	byMessage := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		byMessage[s.Name()+" "+spanAttr(s, "messaging.message.id").AsString()] = s
	}
	for key, want := range map[string]struct {
		errType string
		dest    string
	}{
		"publish no-such-queue m-lost": {ErrorTypeUnroutable, ""},
		"publish amq.direct m-1":       {"", "amq.direct"},
		"ack traced m-1":               {"", "amq.direct"},
		"ack traced m-2":               {ErrorTypeChannelClosed, "amq.direct"},
	} {
		s, ok := byMessage[key]
		if !ok {
			t.Errorf("no span %q among %v", key, slices.Collect(maps.Keys(byMessage)))
			continue
		}
		if got := spanAttr(s, "error.type").AsString(); got != want.errType {
			t.Errorf("%s: error.type %q, want %q", key, got, want.errType)
		}
		if failed := s.Status().Code == codes.Error; failed != (want.errType != "") {
			t.Errorf("%s: status %v", key, s.Status())
		}
		if v := spanAttr(s, "messaging.destination.name"); v.Type() != attribute.STRING || v.AsString() != want.dest {
			t.Errorf("%s: messaging.destination.name %v, want %q", key, v.Emit(), want.dest)
		}
	}
}

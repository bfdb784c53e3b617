package rabbitmq

import (
	"context"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
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
		endProcess(span, Verdict{Action: Ack}, nil)
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

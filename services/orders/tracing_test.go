package main

import (
	"cmp"
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/internal/tracing"
)

// startTraced runs orders serve with tel until the test ends.
func startTraced(t *testing.T, env map[string]string, tel *tracing.Telemetry) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- runTraced(ctx, nil, func(k string) string { return env[k] }, &logs, &logs, tel)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("orders: %v", err)
			}
		case <-time.After(20 * time.Second):
			t.Error("orders did not stop")
		}
		if t.Failed() {
			t.Logf("orders logs:\n%s", logs.String())
		}
	})
}

// waitSpans waits until ok holds for the exported spans, and returns them.
func waitSpans(t *testing.T, exp *tracetest.InMemoryExporter, what string, ok func([]tracetest.SpanStub) bool) []tracetest.SpanStub {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		spans := exp.GetSpans()
		if ok(spans) {
			return spans
		}
		if time.Now().After(deadline) {
			t.Fatalf("never got %s; spans: %v", what, names(spans))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func names(spans []tracetest.SpanStub) []string {
	var n []string
	for _, s := range spans {
		n = append(n, s.Name+"/"+s.SpanContext.SpanID().String()+"<-"+s.Parent.SpanID().String())
	}
	return n
}

func attr(s tracetest.SpanStub, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

func byTrace(spans []tracetest.SpanStub, traceID string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range spans {
		if s.SpanContext.TraceID().String() == traceID {
			out = append(out, s)
		}
	}
	return out
}

func traceparentOf(s tracetest.SpanStub) string {
	return "00-" + s.SpanContext.TraceID().String() + "-" + s.SpanContext.SpanID().String() + "-" + s.SpanContext.TraceFlags().String()
}

// One order, traced through the API, the write and the relay, with real
// PostgreSQL and RabbitMQ: the server span is the write span's parent, the
// publish span is a child of the write span's context stored with the event,
// with the messaging attributes, and the AMQP message carries the publish
// span's context and the client's baggage. A first attempt that fails
// (unroutable: no queue bound yet) and its retry are both in that trace. An
// unsampled request records nothing, and its message still carries the trace
// id, unsampled, and the baggage.
func TestOneTraceFromRequestToBroker(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.AlwaysSample())))
	tel := &tracing.Telemetry{TracerProvider: tp, Propagator: tracing.Propagator(), Shutdown: tp.Shutdown}
	amqpURL := newVhost(t)
	addr := freeAddr(t)
	startTraced(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": amqpURL, "HTTP_ADDR": addr,
		"RELAY_POLL_INTERVAL": "100ms", "RELAY_BACKOFF_MIN": "100ms", "RELAY_BACKOFF_MAX": "500ms",
	}, tel)
	base := "http://" + addr
	waitReady(t, base)

	// Sampled, with baggage; no queue is bound yet, so the first publish is
	// returned by the broker.
	const clientTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	status, o := post(t, base+"/orders", orderBody,
		"Traceparent", "00-"+clientTrace+"-00f067aa0ba902b7-01", "Baggage", "tenant=acme")
	if status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	orderID := o["id"].(string)
	waitSpans(t, exp, "a failed publish", func(spans []tracetest.SpanStub) bool {
		for _, s := range byTrace(spans, clientTrace) {
			if strings.HasPrefix(s.Name, "publish") && s.Status.Code == codes.Error {
				return true
			}
		}
		return false
	})
	deliveries := bindQueue(t, amqpURL)
	m := receive(t, deliveries)
	if m.Headers["aggregate_id"] != orderID {
		t.Fatalf("message %v, want the order's event", m.Headers)
	}
	spans := waitSpans(t, exp, "the publish that succeeded", func(spans []tracetest.SpanStub) bool {
		for _, s := range byTrace(spans, clientTrace) {
			if strings.HasPrefix(s.Name, "publish") && s.Status.Code != codes.Error {
				return true
			}
		}
		return false
	})
	var server, write tracetest.SpanStub
	var publishes []tracetest.SpanStub
	for _, s := range byTrace(spans, clientTrace) {
		switch {
		case s.Name == "POST /orders":
			server = s
		case s.Name == "orders.create":
			write = s
		case strings.HasPrefix(s.Name, "publish"):
			publishes = append(publishes, s)
		}
	}
	if server.SpanKind != trace.SpanKindServer || server.Parent.SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("server span %v kind %v parent %v; spans %v", server.Name, server.SpanKind, server.Parent, names(spans))
	}
	if write.Parent.SpanID() != server.SpanContext.SpanID() {
		t.Fatalf("write span parent %v, want the server span %v", write.Parent.SpanID(), server.SpanContext.SpanID())
	}
	// The queue is bound once a first attempt failed: one or more failed
	// attempts, then the one that succeeded, all in this trace.
	if len(publishes) < 2 {
		t.Fatalf("%d publish spans in the trace, want the failed attempts and the retry: %v", len(publishes), names(spans))
	}
	slices.SortFunc(publishes, func(a, b tracetest.SpanStub) int {
		return cmp.Compare(attr(a, "outbox.attempt").AsInt64(), attr(b, "outbox.attempt").AsInt64())
	})
	ok := publishes[len(publishes)-1]
	for i, p := range publishes {
		wantCode := codes.Error
		if i == len(publishes)-1 {
			wantCode = codes.Unset
		}
		if p.Status.Code != wantCode || attr(p, "outbox.attempt").AsInt64() != int64(i+1) {
			t.Errorf("publish %d: status %v attempt %v, want %v and attempt %d", i, p.Status, attr(p, "outbox.attempt"), wantCode, i+1)
		}
	}
	for _, p := range publishes {
		if p.Parent.SpanID() != write.SpanContext.SpanID() || !p.Parent.IsRemote() || p.SpanKind != trace.SpanKindProducer {
			t.Errorf("%s: parent %v kind %v, want a producer child of the stored write span", p.Name, p.Parent, p.SpanKind)
		}
		for k, want := range map[attribute.Key]string{
			"messaging.system": "rabbitmq", "messaging.operation.type": "send", "messaging.destination.name": "orders.events",
			"messaging.rabbitmq.destination.routing_key": "order.created", "messaging.message.id": m.MessageId,
			"outbox.aggregate.id": orderID, "outbox.event.type": "order.created",
		} {
			if got := attr(p, k).AsString(); got != want {
				t.Errorf("%s: %s = %q, want %q", p.Name, k, got, want)
			}
		}
	}
	if p := ok.Name; p != "publish orders.events" {
		t.Errorf("span name %q", p)
	}
	if got := m.Headers["traceparent"]; got != traceparentOf(ok) {
		t.Errorf("AMQP traceparent %v, want the successful publish span's %s", got, traceparentOf(ok))
	}
	if got := m.Headers["baggage"]; got != "tenant=acme" {
		t.Errorf("AMQP baggage %v, want the client's", got)
	}

	// Unsampled, with baggage.
	const unsampledTrace = "0af7651916cd43dd8448eb211c80319c"
	if status, o := post(t, base+"/orders", orderBody,
		"Traceparent", "00-"+unsampledTrace+"-b7ad6b7169203331-00", "Baggage", "tenant=beta"); status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	m = receive(t, deliveries)
	tpHeader, _ := m.Headers["traceparent"].(string)
	if !strings.HasPrefix(tpHeader, "00-"+unsampledTrace+"-") || !strings.HasSuffix(tpHeader, "-00") || m.Headers["baggage"] != "tenant=beta" {
		t.Errorf("unsampled: AMQP headers %v, want the trace id, flags 00 and the baggage", m.Headers)
	}
	// A later sampled order's publish span is exported after the unsampled
	// order was published: by then nothing of the unsampled trace was.
	if status, o := post(t, base+"/orders", orderBody, "Traceparent", "00-"+strings.Repeat("ab", 16)+"-00f067aa0ba902b7-01"); status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	receive(t, deliveries)
	spans = waitSpans(t, exp, "the later order's publish", func(spans []tracetest.SpanStub) bool {
		for _, s := range byTrace(spans, strings.Repeat("ab", 16)) {
			if strings.HasPrefix(s.Name, "publish") {
				return true
			}
		}
		return false
	})
	if got := byTrace(spans, unsampledTrace); len(got) != 0 {
		t.Errorf("the unsampled request recorded %v", names(got))
	}
}

package main

import (
	"cmp"
	"context"
	"encoding/json"
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
	startTracedLogs(t, env, tel)
}

// tracedLogs are the logs of an orders process.
type tracedLogs struct{ *syncBuffer }

// hasLine reports whether a JSON log line with msg carries sc's trace id.
func (l tracedLogs) hasLine(msg string, sc trace.SpanContext) bool {
	for _, raw := range strings.Split(l.String(), "\n") {
		var line map[string]any
		if json.Unmarshal([]byte(raw), &line) == nil && line["msg"] == msg && line["trace_id"] == sc.TraceID().String() {
			return true
		}
	}
	return false
}

// startTracedLogs runs orders serve with tel until the test ends, and
// returns its logs.
func startTracedLogs(t *testing.T, env map[string]string, tel *tracing.Telemetry) tracedLogs {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	logs := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- runTraced(ctx, nil, func(k string) string { return env[k] }, logs, logs, tel)
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
	return tracedLogs{logs}
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

// inMemoryTracing is tracing to an in-memory exporter, sampling as the
// services do by default (parent-based, always on).
func inMemoryTracing() (*tracetest.InMemoryExporter, *tracing.Telemetry) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.AlwaysSample())))
	return exp, &tracing.Telemetry{TracerProvider: tp, Propagator: tracing.Propagator(), Shutdown: tp.Shutdown}
}

// spanByName returns the spans named name.
func spanByName(spans []tracetest.SpanStub, name string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func linksTo(s tracetest.SpanStub, sc trace.SpanContext) bool {
	for _, l := range s.Links {
		if l.SpanContext.TraceID() == sc.TraceID() && l.SpanContext.SpanID() == sc.SpanID() {
			return true
		}
	}
	return false
}

// One order, traced through the API, the write and the relay, with real
// PostgreSQL and RabbitMQ: the server span is the write span's parent; the
// write span is the parent of the event's PRODUCER create span, whose
// context is stored with the event and is what the AMQP message carries,
// with the allowed baggage only, and which records the message id; each
// publish attempt is a CLIENT child of the create span (the event is young) linked to it. A first attempt
// that fails (unroutable: no queue bound yet) has error.type, and its retry
// is another span. A log line written in the request carries its trace id.
// An unsampled request records nothing, and its message still carries the
// trace id, unsampled, and the allowed baggage.
func TestOneTraceFromRequestToBroker(t *testing.T) {
	t.Parallel()
	exp, tel := inMemoryTracing()
	amqpURL := newVhost(t)
	addr := freeAddr(t)
	logs := startTracedLogs(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": amqpURL, "HTTP_ADDR": addr,
		"RELAY_POLL_INTERVAL": "100ms", "RELAY_BACKOFF_MIN": "100ms", "RELAY_BACKOFF_MAX": "500ms",
		"TRACE_BAGGAGE_KEYS": "tenant",
	}, tel)
	base := "http://" + addr
	waitReady(t, base)

	// Sampled, with baggage; no queue is bound yet, so the first publish is
	// returned by the broker.
	const clientTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	status, o := post(t, base+"/orders", orderBody,
		"Traceparent", "00-"+clientTrace+"-00f067aa0ba902b7-01", "Baggage", "tenant=acme,session=s-91")
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
	var server, write, create tracetest.SpanStub
	var publishes []tracetest.SpanStub
	for _, s := range byTrace(spans, clientTrace) {
		switch {
		case s.Name == "POST /orders":
			server = s
		case s.Name == "orders.create":
			write = s
		case s.Name == "create orders.events":
			create = s
		case strings.HasPrefix(s.Name, "publish"):
			publishes = append(publishes, s)
		}
	}
	if server.SpanKind != trace.SpanKindServer || server.Parent.SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("server span %v kind %v parent %v; spans %v", server.Name, server.SpanKind, server.Parent, names(spans))
	}
	if write.Parent.SpanID() != server.SpanContext.SpanID() || write.SpanKind != trace.SpanKindInternal {
		t.Fatalf("write span parent %v kind %v, want an internal child of the server span %v", write.Parent.SpanID(), write.SpanKind, server.SpanContext.SpanID())
	}
	if attr(write, "db.system.name").Type() != attribute.INVALID {
		t.Errorf("the internal write span carries db.system.name: database attributes belong to database client spans")
	}
	if create.Parent.SpanID() != write.SpanContext.SpanID() || create.SpanKind != trace.SpanKindProducer {
		t.Fatalf("create span parent %v kind %v, want a producer child of the write span", create.Parent.SpanID(), create.SpanKind)
	}
	for k, want := range map[attribute.Key]string{
		"messaging.system": "rabbitmq", "messaging.operation.type": "create", "messaging.destination.name": "orders.events",
		"outbox.aggregate.id": orderID, "outbox.event.type": "order.created", "messaging.message.id": m.MessageId,
	} {
		if got := attr(create, k).AsString(); got != want {
			t.Errorf("create span: %s = %q, want %q", k, got, want)
		}
	}
	// The queue is bound once a first attempt failed: one or more failed
	// attempts, then the one that succeeded.
	if len(publishes) < 2 {
		t.Fatalf("%d publish spans in the trace, want the failed attempts and the retry: %v", len(publishes), names(spans))
	}
	slices.SortFunc(publishes, func(a, b tracetest.SpanStub) int {
		return cmp.Compare(attr(a, "outbox.attempt").AsInt64(), attr(b, "outbox.attempt").AsInt64())
	})
	for i, p := range publishes {
		wantCode, wantErrType := codes.Error, "unroutable"
		if i == len(publishes)-1 {
			wantCode, wantErrType = codes.Unset, ""
		}
		if p.Status.Code != wantCode || attr(p, "outbox.attempt").AsInt64() != int64(i+1) || attr(p, "error.type").AsString() != wantErrType {
			t.Errorf("publish %d: status %v attempt %v error.type %q, want %v, attempt %d and %q", i, p.Status, attr(p, "outbox.attempt"), attr(p, "error.type").AsString(), wantCode, i+1, wantErrType)
		}
		// The create span is the message's PRODUCER span: the publish is CLIENT.
		if p.Parent.SpanID() != create.SpanContext.SpanID() || !p.Parent.IsRemote() || p.SpanKind != trace.SpanKindClient || !linksTo(p, create.SpanContext) {
			t.Errorf("%s: parent %v kind %v links %v, want a client child of the stored create span, linked to it", p.Name, p.Parent, p.SpanKind, p.Links)
		}
		for k, want := range map[attribute.Key]string{
			"messaging.system": "rabbitmq", "messaging.operation.type": "send", "messaging.destination.name": "orders.events",
			"messaging.rabbitmq.destination.routing_key": "order.created", "messaging.message.id": m.MessageId,
			"outbox.aggregate.id": orderID, "outbox.event.type": "order.created", "server.address": "127.0.0.1",
		} {
			if got := attr(p, k).AsString(); got != want {
				t.Errorf("%s: %s = %q, want %q", p.Name, k, got, want)
			}
		}
		if attr(p, "server.port").AsInt64() == 0 {
			t.Errorf("%s: no server.port", p.Name)
		}
	}
	if p := publishes[len(publishes)-1].Name; p != "publish orders.events" {
		t.Errorf("span name %q", p)
	}
	if got := m.Headers["traceparent"]; got != traceparentOf(create) {
		t.Errorf("AMQP traceparent %v, want the create span's %s", got, traceparentOf(create))
	}
	if got := m.Headers["baggage"]; got != "tenant=acme" {
		t.Errorf("AMQP baggage %v, want the client's tenant only (TRACE_BAGGAGE_KEYS=tenant)", got)
	}
	if !logs.hasLine("order created", server.SpanContext) {
		t.Errorf("no \"order created\" log line with the request's trace_id %s:\n%s", server.SpanContext.TraceID(), logs.String())
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

// The public API's trust boundary: a caller outside TRACE_TRUSTED_PEERS
// does not set the trace: its request is the root of a new trace, linked to
// the context it sent, and its baggage is dropped, so none is stored. With
// TRACE_DB=true, the database statements are spans of the write.
func TestUntrustedCallerStartsATraceAndItsBaggageIsDropped(t *testing.T) {
	t.Parallel()
	exp, tel := inMemoryTracing()
	amqpURL := newVhost(t)
	addr := freeAddr(t)
	startTraced(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": amqpURL, "HTTP_ADDR": addr, "RELAY_POLL_INTERVAL": "100ms",
		"TRACE_TRUSTED_PEERS": "10.0.0.0/8", "TRACE_BAGGAGE_KEYS": "tenant", "TRACE_DB": "true",
	}, tel)
	base := "http://" + addr
	waitReady(t, base)
	deliveries := bindQueue(t, amqpURL)
	const clientTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	if status, o := post(t, base+"/orders", orderBody,
		"Traceparent", "00-"+clientTrace+"-00f067aa0ba902b7-01", "Baggage", "tenant=acme"); status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	m := receive(t, deliveries)
	spans := waitSpans(t, exp, "the server span", func(spans []tracetest.SpanStub) bool { return len(spanByName(spans, "POST /orders")) == 1 })
	server := spanByName(spans, "POST /orders")[0]
	if server.SpanContext.TraceID().String() == clientTrace || server.Parent.IsValid() {
		t.Fatalf("server span in trace %s under %v: an untrusted caller set the trace", server.SpanContext.TraceID(), server.Parent)
	}
	if len(server.Links) != 1 || server.Links[0].SpanContext.TraceID().String() != clientTrace {
		t.Errorf("server span links %v, want one to the caller's context", server.Links)
	}
	if tp, _ := m.Headers["traceparent"].(string); !strings.Contains(tp, server.SpanContext.TraceID().String()) {
		t.Errorf("AMQP traceparent %q, want the server span's trace %s", tp, server.SpanContext.TraceID())
	}
	if b, ok := m.Headers["baggage"]; ok {
		t.Errorf("AMQP baggage %v from an untrusted caller", b)
	}
	write := spanByName(spans, "orders.create")[0]
	var statements int
	for _, s := range byTrace(spans, server.SpanContext.TraceID().String()) {
		if s.SpanKind == trace.SpanKindClient && s.Parent.SpanID() == write.SpanContext.SpanID() {
			statements++
		}
	}
	if statements == 0 {
		t.Errorf("TRACE_DB=true: no database span under the write; spans %v", names(spans))
	}
}

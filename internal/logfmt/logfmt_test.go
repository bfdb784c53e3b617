package logfmt

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func TestDurationsAreTextAndServiceIsTagged(t *testing.T) {
	var buf bytes.Buffer
	New(&buf, slog.LevelInfo, "orders").Info("retrying", "retry_in", 1500*time.Millisecond, "attempt", 3)
	New(&buf, slog.LevelInfo, "orders").Debug("hidden")
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
		t.Fatalf("not one JSON line: %q: %v", buf.String(), err)
	}
	if line["retry_in"] != "1.5s" || line["attempt"] != float64(3) || line["service"] != "orders" {
		t.Fatalf("got %v", line)
	}
}

// A line logged inside a span carries its trace_id and span_id; one logged
// without a span, or without a context, carries neither.
func TestLinesInsideASpanCarryItsIDs(t *testing.T) {
	var buf bytes.Buffer
	log := New(&buf, slog.LevelInfo, "shipping").With("role", "consumer")
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{0x4b, 0xf9, 1}, SpanID: trace.SpanID{0x00, 0xf0, 2}, TraceFlags: trace.FlagsSampled,
	})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	log.InfoContext(ctx, "applied", "event_id", "1")
	log.InfoContext(context.Background(), "no span")
	log.Info("no context")
	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	if len(lines) != 3 {
		t.Fatalf("%d lines: %s", len(lines), buf.String())
	}
	for i, raw := range lines {
		var line map[string]any
		if err := json.Unmarshal(raw, &line); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			if line["trace_id"] != sc.TraceID().String() || line["span_id"] != sc.SpanID().String() || line["role"] != "consumer" {
				t.Errorf("line inside the span: %v, want trace_id %s and span_id %s", line, sc.TraceID(), sc.SpanID())
			}
			continue
		}
		if _, ok := line["trace_id"]; ok {
			t.Errorf("line outside any span: %v, want no trace_id", line)
		}
	}
}

// Under a group the trace ids stay top-level keys, beside the attributes
// given before the group; the record's own attributes, and those given
// after, go in the group.
func TestTraceIDsStayTopLevelUnderAGroup(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, span := tp.Tracer("t").Start(context.Background(), "delivery")
	defer span.End()
	sc := span.SpanContext()

	var buf bytes.Buffer
	base := New(&buf, slog.LevelInfo, "shipping").With("role", "consumer")
	base.WithGroup("delivery").With("queue", "q").WithGroup("inner").InfoContext(ctx, "applied", "event_id", "1")
	base.WithGroup("delivery").InfoContext(context.Background(), "no span", "event_id", "2")
	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	if len(lines) != 2 {
		t.Fatalf("%d lines: %s", len(lines), buf.String())
	}
	var line map[string]any
	if err := json.Unmarshal(lines[0], &line); err != nil {
		t.Fatal(err)
	}
	if line["trace_id"] != sc.TraceID().String() || line["span_id"] != sc.SpanID().String() {
		t.Fatalf("line under a group: %s, want trace_id %s and span_id %s at the top level", lines[0], sc.TraceID(), sc.SpanID())
	}
	delivery, _ := line["delivery"].(map[string]any)
	inner, _ := delivery["inner"].(map[string]any)
	if line["service"] != "shipping" || line["role"] != "consumer" || delivery["queue"] != "q" || inner["event_id"] != "1" {
		t.Fatalf("line under a group: %s, want service and role at the top, delivery.queue and delivery.inner.event_id", lines[0])
	}
	if _, nested := delivery["trace_id"]; nested {
		t.Fatalf("line under a group: %s, trace_id inside the group", lines[0])
	}
	var plain map[string]any
	if err := json.Unmarshal(lines[1], &plain); err != nil {
		t.Fatal(err)
	}
	if d, _ := plain["delivery"].(map[string]any); plain["trace_id"] != nil || d["event_id"] != "2" {
		t.Fatalf("line without a span: %s", lines[1])
	}
}

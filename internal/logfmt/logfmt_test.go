package logfmt

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

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

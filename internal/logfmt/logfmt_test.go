package logfmt

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"testing"
	"time"
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

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The failed-run messages the checker reads are the ones shipping logs: a
// renamed message would silently stop explaining the runs it explains.
func TestFailedRunLogsAreShippings(t *testing.T) {
	src, err := os.ReadFile(filepath.Join("..", "services", "shipping", "internal", "processor", "processor.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range failedRunLogs {
		if !strings.Contains(string(src), `"`+m+`"`) {
			t.Errorf("shipping's processor logs no %q", m)
		}
	}
}

func TestLogWritersReadsFailedRunsOfEachRun(t *testing.T) {
	log := `=== chaos: shipping-1 start #1 at 2026-12-04T20:47:47.246839654Z []
{"time":"2026-12-04T20:47:47.37Z","level":"INFO","msg":"shipping service starting","effect_log_writer":"AAA/1"}
{"time":"2026-12-04T20:49:41.525Z","level":"WARN","msg":"inbox failed, deferring the message","event_id":"m1","error":"x"}
{"time":"2026-12-04T20:49:41.6Z","level":"WARN","msg":"could not settle delivery, will handle it again","event_id":"m2"}
=== chaos: shipping-1 #1 exited: signal: killed at 2026-12-04T20:49:50Z
=== chaos: shipping-1 start #2 at 2026-12-04T20:49:51Z []
{"time":"2026-12-04T20:49:51.1Z","level":"WARN","msg":"handler failed","event_id":"m3","error":"y"}
{"time":"2026-12-04T20:49:51.2Z","level":"INFO","msg":"shipping service starting","effect_log_writer":"BBB/2"}
{"time":"2026-12-04T20:49:52Z","level":"WARN","msg":"MongoDB unavailable, keeping the delivery until it is back","event_id":"m4","error":"z"}
`
	path := filepath.Join(t.TempDir(), "shipping-1.log")
	if err := os.WriteFile(path, []byte(log), 0o600); err != nil {
		t.Fatal(err)
	}
	ws, fs, err := logWriters("shipping-1", path)
	if err != nil {
		t.Fatal(err)
	}
	if len(ws) != 2 || ws[0].ID != "AAA/1" || !ws[0].Killed || ws[1].ID != "BBB/2" {
		t.Errorf("writers %+v", ws)
	}
	// m2 did not fail its run; m3's line came before its run named its
	// writer, so it is not attributed.
	if len(fs) != 2 || fs[0].MessageID != "m1" || fs[0].Writer != "AAA/1" ||
		!fs[0].At.Equal(time.Date(2026, 12, 4, 20, 49, 41, 525e6, time.UTC)) ||
		fs[1].MessageID != "m4" || fs[1].Writer != "BBB/2" {
		t.Errorf("failures %+v", fs)
	}
}

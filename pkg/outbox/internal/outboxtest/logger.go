package outboxtest

import (
	"io"
	"log/slog"
	"strings"
	"testing"
)

// Logger is a logger for a test: its records go to t.Log under -v (debug
// level and up), and nowhere otherwise.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// LogWriter writes each line to t.Log under -v, and discards it otherwise.
func LogWriter(t testing.TB) io.Writer {
	if testing.Verbose() {
		return tWriter{t}
	}
	return io.Discard
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

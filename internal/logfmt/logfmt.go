// Package logfmt builds the services' structured loggers, so every process
// logs the same JSON shape.
package logfmt

import (
	"io"
	"log/slog"
	"time"
)

// New returns a JSON logger at level writing to w, tagged with the service's
// name. Durations are written as text ("1.5s"), not as raw nanoseconds.
func New(w io.Writer, level slog.Leveler, service string) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindDuration {
				return slog.String(a.Key, a.Value.Duration().Round(time.Microsecond).String())
			}
			return a
		},
	})).With("service", service)
}

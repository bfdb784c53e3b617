package outboxamqp

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

type warnings struct {
	mu    sync.Mutex
	lines []string
}

func (h *warnings) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (h *warnings) WithAttrs([]slog.Attr) slog.Handler           { return h }
func (h *warnings) WithGroup(string) slog.Handler                { return h }
func (h *warnings) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lines = append(h.lines, r.Message)
	return nil
}

func (h *warnings) count(part string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, l := range h.lines {
		if strings.Contains(l, part) {
			n++
		}
	}
	return n
}

// A connection whose frame_max is too small for the headers Enqueue admits
// is said so at connect time; the default one is not.
func TestPublisherWarnsOfAFrameMaxTooSmallForTheHeaders(t *testing.T) {
	t.Parallel()
	_, exchange := returnsExchange(t)
	for _, c := range []struct {
		frameSize int
		warned    int
	}{{0, 0}, {16 << 10, 1}} {
		w := &warnings{}
		p, err := NewPublisher(Config{URL: outboxtest.AMQPURL(), Exchange: exchange, Logger: slog.New(w)})
		if err != nil {
			t.Fatal(err)
		}
		p.frameSize = c.frameSize
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = p.WaitReady(ctx)
		cancel()
		_ = p.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got := w.count("frame_max is smaller"); got != c.warned {
			t.Errorf("frame size %d: warned %d times, want %d", c.frameSize, got, c.warned)
		}
	}
}

package outbox_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// retryLog records the retry_in of each "LISTEN connection lost" warning.
type retryLog struct {
	mu    *sync.Mutex
	waits *[]time.Duration
}

func (h retryLog) Enabled(context.Context, slog.Level) bool { return true }
func (h retryLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h retryLog) WithGroup(string) slog.Handler            { return h }
func (h retryLog) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "outbox relay: LISTEN connection lost, reconnecting" {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "retry_in" {
			h.mu.Lock()
			*h.waits = append(*h.waits, a.Value.Duration())
			h.mu.Unlock()
		}
		return true
	})
	return nil
}

// A LISTEN connection whose probe cannot send its notification (the pool
// is down, as while a PgBouncer restarts, while the direct LISTEN URL
// works) is a failure like any other: the relay backs off more each time
// instead of opening a new connection to PostgreSQL every 100ms.
func TestListenProbeFailureBacksOff(t *testing.T) {
	t.Parallel()
	listenCfg, err := pgx.ParseConfig(testDatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	// A pool nobody answers: the probe's pg_notify fails at once.
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var mu sync.Mutex
	var waits []time.Duration
	cfg := fastConfig(t)
	cfg.Logger = slog.New(retryLog{mu: &mu, waits: &waits})
	cfg.NotifyChannel = "outbox_test_probe_backoff"
	cfg.ListenConfig = listenCfg
	startRelay(t, pool, &memPublisher{}, cfg)
	waitFor(t, "five LISTEN failures", time.Minute, func() (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		return len(waits) >= 5, nil
	})
	mu.Lock()
	defer mu.Unlock()
	// backoff(5) is 1.6s, jittered over [0.8s, 1.6s]; without growth it
	// stays at most 100ms.
	if waits[4] < 400*time.Millisecond {
		t.Fatalf("retry waits after failed probes %v: the backoff does not grow", waits[:5])
	}
}

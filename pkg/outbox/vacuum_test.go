package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// vacuumCount is how many manual VACUUMs the test's outbox table has had.
func vacuumCount(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(),
		`SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).Scan(&n); err != nil {
		t.Fatalf("read vacuum_count: %v", err)
	}
	return n
}

func manyAggregates(n int) []outbox.Message {
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = msg(fmt.Sprintf("v-%d", i), "order.created")
	}
	return msgs
}

func TestRelayVacuumsTheOutboxEveryNRowsMoved(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	enqueue(t, pool, manyAggregates(200)...)

	cfg := fastConfig(t)
	cfg.VacuumEvery = 50 // each batch of 100 moved rows asks for one
	startRelay(t, pool, &memPublisher{}, cfg)
	waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))
	waitFor(t, "two vacuums", 10*time.Second, func() (bool, error) { return vacuumCount(t, pool) >= 2, nil })

	// (What a vacuum can remove depends on the oldest snapshot open anywhere
	// in the cluster, other tests' included, so the dead tuples left are not
	// checked here; bench's claim_flat measures the effect.)
}

// In auto mode the relay vacuums only when autovacuum does not cover the
// table, and then at once (what piled up before it started) and every 5,000
// rows; -1 turns it off.
func TestRelayVacuumsInAutoModeOnlyWithoutAutovacuum(t *testing.T) {
	t.Parallel()

	t.Run("autovacuum off for the table", func(t *testing.T) {
		t.Parallel()
		pool := newTestPool(t)
		if _, err := pool.Exec(context.Background(), `ALTER TABLE outbox SET (autovacuum_enabled = false)`); err != nil {
			t.Fatal(err)
		}
		startRelay(t, pool, &memPublisher{}, fastConfig(t))
		waitFor(t, "a vacuum at start", 10*time.Second, func() (bool, error) { return vacuumCount(t, pool) >= 1, nil })
	})

	t.Run("never", func(t *testing.T) {
		t.Parallel()
		pool := newTestPool(t)
		if _, err := pool.Exec(context.Background(), `ALTER TABLE outbox SET (autovacuum_enabled = false)`); err != nil {
			t.Fatal(err)
		}
		enqueue(t, pool, manyAggregates(200)...)
		cfg := fastConfig(t)
		cfg.VacuumEvery = -1
		startRelay(t, pool, &memPublisher{}, cfg)
		waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))
		time.Sleep(300 * time.Millisecond)
		if n := vacuumCount(t, pool); n != 0 {
			t.Fatalf("VacuumEvery -1: %d vacuums, want 0", n)
		}
	})

	t.Run("autovacuum on", func(t *testing.T) {
		t.Parallel()
		pool := newTestPool(t)
		var on bool
		if err := pool.QueryRow(context.Background(), `SELECT current_setting('autovacuum')::bool`).Scan(&on); err != nil {
			t.Fatal(err)
		}
		if !on {
			t.Skip("this server runs with autovacuum=off, so the case where autovacuum covers the table cannot be set up per test")
		}
		enqueue(t, pool, manyAggregates(200)...)
		startRelay(t, pool, &memPublisher{}, fastConfig(t))
		waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))
		time.Sleep(300 * time.Millisecond)
		if n := vacuumCount(t, pool); n != 0 {
			t.Fatalf("auto mode with autovacuum on: %d vacuums by the relay, want 0", n)
		}
	})
}

package outbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// schema2InsertSQL is how writers of schema 2 and earlier inserted a row:
// blocked when the aggregate's published_version (which the relay no longer
// advances) lags behind. Beside a relay of today, such a writer inserts its
// row blocked with nothing before it once the aggregate's previous event was
// published.
const schema2InsertSQL = `
WITH v AS (
    INSERT INTO outbox_aggregates AS a (aggregate_type, aggregate_id, version)
    VALUES ($1, $2, 1)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = a.version + 1
    RETURNING version, published_version
)
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, blocked)
SELECT $1, $2, v.version, $3, $4, '{}', v.version > v.published_version + 1 FROM v
RETURNING id`

func oldWriterEnqueue(t *testing.T, pool *pgxpool.Pool, aggregateID, eventType string) int64 {
	t.Helper()
	var id int64
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		return tx.QueryRow(context.Background(), schema2InsertSQL, "order", aggregateID, eventType, `{}`).Scan(&id)
	})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

type strandedMetrics struct {
	released atomic.Int64
}

func (m *strandedMetrics) Observe(_ context.Context, o outbox.Observation) {
	if o.Kind == outbox.KindStranded {
		m.released.Add(int64(o.N))
	}
}

// A row blocked with no earlier event of its aggregate left in the outbox is
// never claimed, and is no dead letter an operator could retry: the relay
// must find it and release it. Two ways to get one: a writer of an older
// version of this package beside this relay, and an earlier event deleted by
// hand. Admin.Stranded counts them, the relay releases them on its periodic
// check, reports them as KindStranded, and they are published in order.
func TestRelayReleasesRowsBlockedBehindNothing(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	// An old writer's first event, published by today's relay...
	pub := &memPublisher{}
	cfg := fastConfig(t)
	cfg.StrandedCheckInterval = time.Hour // only the check at start, in this first run
	first := oldWriterEnqueue(t, pool, "old", "order.created")
	stop := runRelay(t, pool, pub, cfg)
	waitFor(t, "the old writer's first event published", 20*time.Second, outboxEmpty(pool))
	stop()
	// ...then its second, which it inserts blocked behind nothing.
	second := oldWriterEnqueue(t, pool, "old", "order.cancelled")
	// And an aggregate whose head was deleted by hand.
	byHand := enqueue(t, pool, msg("by-hand", "order.created"), msg("by-hand", "order.cancelled"))
	if _, err := pool.Exec(ctx, "DELETE FROM outbox WHERE id = $1", byHand[0].ID); err != nil {
		t.Fatal(err)
	}
	// A row blocked behind a real predecessor is not stranded.
	healthy := enqueue(t, pool, msg("healthy", "order.created"), msg("healthy", "order.cancelled"))
	if _, err := pool.Exec(ctx, "UPDATE outbox SET next_attempt_at = now() + interval '1 hour' WHERE id = $1", healthy[0].ID); err != nil {
		t.Fatal(err)
	}

	admin := outbox.NewAdmin(pool)
	if n, err := admin.Stranded(ctx); err != nil || n != 2 {
		t.Fatalf("Stranded = %d, %v; want 2", n, err)
	}
	if err := admin.Retry(ctx, second); err == nil {
		t.Fatal("Retry of a stranded row succeeded: it is no dead letter")
	}

	metrics := &strandedMetrics{}
	cfg.Observer = metrics
	cfg.StrandedCheckInterval = 50 * time.Millisecond
	startRelay(t, pool, pub, cfg)
	waitFor(t, "the stranded rows published", 20*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published WHERE id = ANY($1)", []int64{second, byHand[1].ID}).Scan(&n)
		return n == 2, err
	})
	if got := metrics.released.Load(); got != 2 {
		t.Fatalf("KindStranded counted %d rows, want 2", got)
	}
	var stillBlocked bool
	if err := pool.QueryRow(ctx, "SELECT blocked FROM outbox WHERE id = $1", healthy[1].ID).Scan(&stillBlocked); err != nil || !stillBlocked {
		t.Fatalf("the row behind a pending event: blocked=%v, %v; want it still blocked", stillBlocked, err)
	}
	if n, err := admin.Stranded(ctx); err != nil || n != 0 {
		t.Fatalf("Stranded after the release = %d, %v; want 0", n, err)
	}
	for _, e := range pub.snapshot() {
		if e.ID == first {
			continue
		}
		if e.ID == healthy[1].ID {
			t.Fatal("the row behind a pending event was published")
		}
	}
}

// runRelay runs a relay until the returned function is called.
func runRelay(t *testing.T, pool *pgxpool.Pool, pub outbox.Publisher, cfg outbox.RelayConfig) (stop func()) {
	t.Helper()
	relay, err := outbox.NewRelay(pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once atomic.Bool
	stop = func() {
		if once.CompareAndSwap(false, true) {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		}
	}
	t.Cleanup(stop)
	return stop
}

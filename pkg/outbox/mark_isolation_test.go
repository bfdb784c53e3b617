package outbox_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// batchRecorder records the statements of every batch sent on a pool.
type batchRecorder struct {
	mu      sync.Mutex
	batches [][]string
}

func (r *batchRecorder) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	sqls := make([]string, len(d.Batch.QueuedQueries))
	for i, q := range d.Batch.QueuedQueries {
		sqls[i] = q.SQL
	}
	r.mu.Lock()
	r.batches = append(r.batches, sqls)
	r.mu.Unlock()
	return ctx
}

func (r *batchRecorder) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *batchRecorder) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// Query tracing is required by pgx's tracer field; this recorder ignores queries.
func (r *batchRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (r *batchRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// markBatches returns the recorded batches that move rows to outbox_published.
func (r *batchRecorder) markBatches() [][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out [][]string
	for _, b := range r.batches {
		if slices.ContainsFunc(b, func(s string) bool { return strings.Contains(s, "INSERT INTO outbox_published") }) {
			out = append(out, b)
		}
	}
	return out
}

// The mark moves a row in one statement and unblocks the next event of its
// aggregate in the next one, whose snapshot must see a writer that committed
// in between. That holds at READ COMMITTED only: at a REPEATABLE READ or
// SERIALIZABLE default (ALTER ROLE/DATABASE ... SET
// default_transaction_isolation) both statements would share one snapshot,
// and a writer committing between the snapshot and the move would leave its
// event blocked behind nothing. The interleaving lies inside one statement and
// cannot be forced from a test, so this checks the mark's transaction sets
// its own level, whatever the session's default.
func TestMarkRunsAtReadCommittedWhateverTheSessionDefault(t *testing.T) {
	t.Parallel()
	base := newTestPool(t)
	rec := &batchRecorder{}
	cfg := base.Config()
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	enqueue(t, base, msg("o-1", "order.created"), msg("o-2", "order.created"))
	pub := &memPublisher{}
	startRelay(t, pool, pub, fastConfig(t))
	waitFor(t, "both events published", 20*time.Second, func() (bool, error) {
		return len(pub.Snapshot()) == 2 && len(rec.markBatches()) > 0, nil
	})
	for _, b := range rec.markBatches() {
		if len(b) == 0 || !strings.EqualFold(strings.TrimSpace(b[0]), "BEGIN ISOLATION LEVEL READ COMMITTED") ||
			!strings.EqualFold(strings.TrimSpace(b[len(b)-1]), "COMMIT") {
			t.Fatalf("a mark batch does not run in a READ COMMITTED transaction of its own: %q", b)
		}
	}
}

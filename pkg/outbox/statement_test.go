package outbox_test

import (
	"context"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// statementTracer records the Statement of each query and batched query
// its pool sends.
type statementTracer struct {
	mu   sync.Mutex
	seen map[outbox.Statement]int
}

func (s *statementTracer) record(sql string) {
	if st := outbox.StatementOf(sql); st != "" {
		s.mu.Lock()
		s.seen[st]++
		s.mu.Unlock()
	}
}

func (s *statementTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.record(d.SQL)
	return ctx
}
func (s *statementTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (s *statementTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}
func (s *statementTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	s.record(d.SQL)
}
func (s *statementTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (s *statementTracer) snapshot() map[outbox.Statement]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.seen)
}

func (s *statementTracer) count(st outbox.Statement) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen[st]
}

// tracedPool is a second pool on pool's schema whose statements tr sees.
func tracedPool(t *testing.T, pool *pgxpool.Pool, tr *statementTracer) *pgxpool.Pool {
	t.Helper()
	cfg := pool.Config()
	cfg.ConnConfig.Tracer = tr
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// A pgx tracer tells the relays' statements apart with StatementOf: the
// polling relay's claim and mark, the hand-over relay's claim; other SQL
// has no name.
func TestStatementOfNamesTheRelaysStatements(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	tr := &statementTracer{seen: map[outbox.Statement]int{}}
	enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
	startRelay(t, tracedPool(t, pool, tr), &memPublisher{}, fastConfig(t))
	waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))
	waitFor(t, "the mark traced", 5*time.Second, func() (bool, error) { return tr.count(outbox.StatementMark) > 0, nil })
	if tr.count(outbox.StatementClaim) == 0 {
		t.Errorf("the polling relay's claim not recognised: %v", tr.snapshot())
	}

	handed := &statementTracer{seen: map[outbox.Statement]int{}}
	enqueue(t, pool, msg("c", "order.created"))
	if _, err := pool.Exec(ctx, "UPDATE outbox SET handed_over = true"); err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(tracedPool(t, pool, handed), outboxtest.HandOver(&memPublisher{}), fastConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()
	waitFor(t, "the handed-over row published", 20*time.Second, outboxEmpty(pool))
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if handed.count(outbox.StatementClaim) == 0 {
		t.Errorf("the hand-over relay's claims: %v, want claim", handed.snapshot())
	}

	for _, sql := range []string{"", "SELECT 1", outbox.Schema()} {
		if st := outbox.StatementOf(sql); st != "" {
			t.Errorf("StatementOf(%.30q) = %q, want none", sql, st)
		}
	}
}

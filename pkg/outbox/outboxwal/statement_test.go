package outboxwal_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// sweepTracer counts the queries outbox.StatementOf names a sweep.
type sweepTracer struct{ sweeps atomic.Int64 }

func (s *sweepTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if outbox.StatementOf(d.SQL) == outbox.StatementSweep {
		s.sweeps.Add(1)
	}
	return ctx
}
func (s *sweepTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A pgx tracer on the WAL relay's pool tells its sweeps, deleting or
// archiving, by outbox.StatementOf.
func TestStatementOfNamesTheSweep(t *testing.T) {
	for _, archive := range []bool{false, true} {
		t.Run(fmt.Sprintf("archive=%v", archive), func(t *testing.T) {
			pool := walPool(t)
			b := newBroker(t, "#")
			cfg := walConfig(t, pool)
			cfg.Archive = archive
			tr := &sweepTracer{}
			pc := pool.Config()
			pc.ConnConfig.Tracer = tr
			traced, err := pgxpool.NewWithConfig(context.Background(), pc)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(traced.Close)
			relay, _ := startWAL(t, traced, newPublisherForTest(t, b), cfg)
			waitActive(t, relay)
			want := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
			b.waitIDs("the events", want)
			waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
			if tr.sweeps.Load() == 0 {
				t.Fatal("no sweep recognised")
			}
		})
	}
}

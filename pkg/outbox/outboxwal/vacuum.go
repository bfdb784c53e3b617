package outboxwal

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
)

// defaultVacuumEvery is the rows swept between two of the relay's own
// vacuums in auto mode: the threshold the outbox schema gives autovacuum.
const defaultVacuumEvery = 5000

// vacuumer vacuums the outbox table every so many swept rows: every swept
// row leaves a dead tuple and dead index entries, which writers' lookups of
// an aggregate's previous event walk over until a vacuum removes them.
type vacuumer struct {
	r     *Relay
	every int64
	moved int64
	due   chan struct{}
}

// newVacuumer decides the interval (asking the server in auto mode); nil
// means the relay does not vacuum.
func (r *Relay) newVacuumer(ctx context.Context) *vacuumer {
	every := int64(r.cfg.VacuumEvery)
	switch {
	case every < 0:
		return nil
	case every == 0:
		var on bool
		if err := r.pool.QueryRow(ctx, outboxsql.AutovacuumSQL).Scan(&on); err != nil {
			r.log.WarnContext(ctx, "outbox WAL relay: cannot tell whether autovacuum is on; not vacuuming", slog.Any("error", err))
			return nil
		}
		if on {
			return nil
		}
		r.log.InfoContext(ctx, "outbox WAL relay: autovacuum is off for the outbox table; the relay vacuums it",
			slog.Int("every_rows", defaultVacuumEvery))
		every = defaultVacuumEvery
	}
	return &vacuumer{r: r, every: every, due: make(chan struct{}, 1)}
}

// swept counts swept rows; called by the writer alone.
func (v *vacuumer) swept(n int) {
	if v == nil {
		return
	}
	v.moved += int64(n)
	if v.moved >= v.every {
		v.moved = 0
		select {
		case v.due <- struct{}{}:
		default:
		}
	}
}

// run vacuums when due, until ctx ends.
func (v *vacuumer) run(ctx context.Context) {
	if v == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.due:
			start := time.Now()
			// VACUUM cannot run in a transaction block: the simple protocol sends it alone.
			_, err := v.r.pool.Exec(ctx, `VACUUM (SKIP_LOCKED) outbox`, pgx.QueryExecModeSimpleProtocol)
			if err != nil && ctx.Err() == nil {
				v.r.log.WarnContext(ctx, "outbox WAL relay: vacuum failed", slog.Any("error", err))
			} else if err == nil {
				v.r.log.DebugContext(ctx, "outbox WAL relay: vacuumed the outbox table", slog.Duration("duration", time.Since(start)))
			}
		}
	}
}

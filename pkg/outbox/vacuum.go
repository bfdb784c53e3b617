package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
)

// defaultVacuumEvery is the number of rows moved between two of the relay's
// own vacuums in auto mode: the threshold the schema gives autovacuum.
const defaultVacuumEvery = 5000

// vacuumSQL removes the dead tuples and index entries the published rows left
// in outbox. SKIP_LOCKED: when another vacuum (autovacuum's, another relay's)
// holds the table, this one is skipped rather than queued.
const vacuumSQL = `VACUUM (SKIP_LOCKED) outbox`

// vacuumLoop runs the relay's own vacuums (RelayConfig.VacuumEvery) until ctx
// ends. In auto mode it first asks whether autovacuum covers the table, and
// returns if it does.
func (r *Relay) vacuumLoop(ctx context.Context) {
	every := r.cfg.VacuumEvery
	if every == 0 {
		for attempt := 1; ; attempt++ {
			var on bool
			err := r.pool.QueryRow(ctx, outboxsql.AutovacuumSQL).Scan(&on)
			if err == nil {
				if on {
					r.log.DebugContext(ctx, "outbox relay: autovacuum covers the outbox table; the relay will not vacuum it")
					return
				}
				break
			}
			if ctx.Err() != nil {
				return
			}
			r.log.WarnContext(ctx, "outbox relay: cannot tell whether autovacuum is on", slog.Any("error", err), slog.Int("attempt", attempt))
			retry.Sleep(ctx, retry.Jitter(retry.Backoff(attempt, time.Second, time.Minute)))
		}
		r.log.InfoContext(ctx, "outbox relay: autovacuum is off for the outbox table; the relay vacuums it",
			slog.Int("every_rows", defaultVacuumEvery))
		every = defaultVacuumEvery
		// Catch up with what accumulated before this relay started.
		r.vacuum(ctx, "start")
	}
	r.vacuumEvery.Store(int64(every))
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.vacuumDue:
			r.vacuum(ctx, "rows_moved")
		}
	}
}

// movedRows counts rows moved out of outbox and signals vacuumLoop when
// VacuumEvery of them have been moved since the last signal.
func (r *Relay) movedRows(n int) {
	every := r.vacuumEvery.Load()
	if every <= 0 || n == 0 {
		return
	}
	if r.movedSinceVacuum.Add(int64(n)) >= every {
		// Subtract rather than reset, so rows counted meanwhile by another
		// worker are not lost.
		r.movedSinceVacuum.Add(-every)
		select {
		case r.vacuumDue <- struct{}{}:
		default:
		}
	}
}

func (r *Relay) vacuum(ctx context.Context, reason string) {
	start := time.Now()
	// VACUUM cannot run in a transaction block: the simple protocol sends it alone.
	_, err := r.pool.Exec(ctx, vacuumSQL, pgx.QueryExecModeSimpleProtocol)
	switch {
	case ctx.Err() != nil:
	case err != nil:
		r.log.WarnContext(ctx, "outbox relay: vacuum failed", slog.Any("error", fmt.Errorf("%s: %w", vacuumSQL, err)))
	default:
		r.log.DebugContext(ctx, "outbox relay: vacuumed the outbox table", slog.String("reason", reason),
			slog.Duration("duration", time.Since(start)))
	}
}

// Package vacuum runs the relays' own VACUUM of the outbox table: every row a
// relay takes out of the table (the polling relay's move, the WAL relay's
// sweep) leaves a dead tuple and dead index entries, which the claim and the
// writers' lookups walk over until a vacuum removes them. The schema tunes
// autovacuum to do it every 5,000 changes; on a server where autovacuum does
// not cover the table, the relay does it itself. Package outbox owns the
// loop; this package is its seam for outboxwal, so the loop is written once.
package vacuum

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
)

// DefaultEvery is the rows taken out of the table between two vacuums in
// auto mode: the threshold the schema gives autovacuum.
const DefaultEvery = 5000

// SQL removes the dead tuples and index entries the rows taken out of the
// table left. SKIP_LOCKED: when another vacuum (autovacuum's, another
// relay's) holds the table, this one is skipped rather than queued.
const SQL = `VACUUM (SKIP_LOCKED) outbox`

// AutovacuumSQL tells whether autovacuum covers the outbox table: on for the
// server and not switched off for the table.
const AutovacuumSQL = `
SELECT current_setting('autovacuum')::bool
   AND coalesce((SELECT option_value::bool
                 FROM pg_class c, pg_options_to_table(c.reloptions)
                 WHERE c.oid = 'outbox'::regclass AND option_name = 'autovacuum_enabled'), true)`

// DB is what the vacuums need: *pgxpool.Pool satisfies it. VACUUM cannot
// run in a transaction block: give it a pool, not a transaction.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Vacuumer vacuums the outbox table every so many rows taken out of it.
type Vacuumer struct {
	db    DB
	log   *slog.Logger
	name  string // the relay, as its logs name it
	every int    // the configuration: -1 never, 0 auto, or a number of rows

	interval atomic.Int64 // rows between vacuums; 0 until Run decided, and when it does not vacuum
	counted  atomic.Int64 // rows counted since the last vacuum was asked for
	due      chan struct{}
}

// New returns a Vacuumer of db's outbox table. every is the relay's
// VacuumEvery: -1 never vacuums; 0 (auto) vacuums every DefaultEvery rows
// when autovacuum does not cover the table, and never otherwise; a positive
// number vacuums at that interval regardless. name starts its log lines
// ("outbox relay").
func New(db DB, log *slog.Logger, name string, every int) *Vacuumer {
	return &Vacuumer{db: db, log: log, name: name, every: every, due: make(chan struct{}, 1)}
}

// Counted counts n rows taken out of the table, and asks Run for a vacuum
// once the interval's worth of them were counted since the last time it
// asked. Any number of goroutines may call it. Rows counted before Run
// decided, or while it does not vacuum, are not counted.
func (v *Vacuumer) Counted(n int) {
	every := v.interval.Load()
	if every <= 0 || n <= 0 {
		return
	}
	if v.counted.Add(int64(n)) >= every {
		// Subtract rather than reset, so rows counted meanwhile by another
		// goroutine are not lost.
		v.counted.Add(-every)
		select {
		case v.due <- struct{}{}:
		default:
		}
	}
}

// Run vacuums when asked (Counted), until ctx ends. In auto mode it first
// asks whether autovacuum covers the table (retrying with backoff while the
// question fails) and returns if it does; if not, it vacuums at once, for
// what piled up before the relay started. With -1 it returns at once.
func (v *Vacuumer) Run(ctx context.Context) {
	every := v.every
	switch {
	case every < 0:
		return
	case every == 0:
		on, ok := v.autovacuumOn(ctx)
		if !ok {
			return // ctx ended
		}
		if on {
			v.log.DebugContext(ctx, v.name+": autovacuum covers the outbox table; the relay will not vacuum it")
			return
		}
		v.log.InfoContext(ctx, v.name+": autovacuum is off for the outbox table; the relay vacuums it",
			slog.Int("every_rows", DefaultEvery))
		every = DefaultEvery
		v.vacuum(ctx, "start")
	}
	v.interval.Store(int64(every))
	defer v.interval.Store(0)
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.due:
			v.vacuum(ctx, "rows_taken_out")
		}
	}
}

// autovacuumOn asks the server, until it answers or ctx ends (ok false).
func (v *Vacuumer) autovacuumOn(ctx context.Context) (on, ok bool) {
	for attempt := 1; ; attempt++ {
		err := v.db.QueryRow(ctx, AutovacuumSQL).Scan(&on)
		if err == nil {
			return on, true
		}
		if ctx.Err() != nil {
			return false, false
		}
		v.log.WarnContext(ctx, v.name+": cannot tell whether autovacuum is on", slog.Any("error", err), slog.Int("attempt", attempt))
		retry.Sleep(ctx, retry.Jitter(retry.Backoff(attempt, time.Second, time.Minute)))
	}
}

func (v *Vacuumer) vacuum(ctx context.Context, reason string) {
	start := time.Now()
	// VACUUM cannot run in a transaction block: the simple protocol sends it alone.
	_, err := v.db.Exec(ctx, SQL, pgx.QueryExecModeSimpleProtocol)
	switch {
	case ctx.Err() != nil:
	case err != nil:
		v.log.WarnContext(ctx, v.name+": vacuum failed", slog.Any("error", fmt.Errorf("%s: %w", SQL, err)))
	default:
		v.log.DebugContext(ctx, v.name+": vacuumed the outbox table", slog.String("reason", reason),
			slog.Duration("duration", time.Since(start)))
	}
}

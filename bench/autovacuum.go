package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// autovacuumSQL applies autovacuum's own trigger rule to the outbox tables,
// with each table's storage parameters (pkg/outbox/schema.sql sets fixed
// thresholds on outbox) or the server's defaults: VACUUM when dead tuples or
// inserts since the last vacuum exceed their threshold, ANALYZE when changes
// since the last analyze do.
const autovacuumSQL = `
WITH t AS (
    SELECT s.relname, s.n_dead_tup, s.n_ins_since_vacuum, s.n_mod_since_analyze,
           greatest(c.reltuples, 0) AS reltuples,
           coalesce(c.reloptions, '{}') AS opts
    FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
    WHERE s.relname IN ('outbox', 'outbox_published', 'outbox_aggregates')
), o AS (
    SELECT relname, n_dead_tup, n_ins_since_vacuum, n_mod_since_analyze, reltuples,
           (SELECT split_part(x, '=', 2) FROM unnest(opts) x WHERE x LIKE 'autovacuum_vacuum_threshold=%') AS vt,
           (SELECT split_part(x, '=', 2) FROM unnest(opts) x WHERE x LIKE 'autovacuum_vacuum_scale_factor=%') AS vs,
           (SELECT split_part(x, '=', 2) FROM unnest(opts) x WHERE x LIKE 'autovacuum_vacuum_insert_threshold=%') AS it,
           (SELECT split_part(x, '=', 2) FROM unnest(opts) x WHERE x LIKE 'autovacuum_vacuum_insert_scale_factor=%') AS isf,
           (SELECT split_part(x, '=', 2) FROM unnest(opts) x WHERE x LIKE 'autovacuum_analyze_threshold=%') AS at,
           (SELECT split_part(x, '=', 2) FROM unnest(opts) x WHERE x LIKE 'autovacuum_analyze_scale_factor=%') AS asf
    FROM t
)
SELECT relname,
       n_dead_tup > coalesce(vt::float8, current_setting('autovacuum_vacuum_threshold')::float8)
                    + coalesce(vs::float8, current_setting('autovacuum_vacuum_scale_factor')::float8) * reltuples
    OR n_ins_since_vacuum > coalesce(it::float8, current_setting('autovacuum_vacuum_insert_threshold')::float8)
                    + coalesce(isf::float8, current_setting('autovacuum_vacuum_insert_scale_factor')::float8) * reltuples,
       n_mod_since_analyze > coalesce(at::float8, current_setting('autovacuum_analyze_threshold')::float8)
                    + coalesce(asf::float8, current_setting('autovacuum_analyze_scale_factor')::float8) * reltuples
FROM o`

// autovacuum stands in for the autovacuum daemon, which this server runs
// with autovacuum=off: every naptime it vacuums and analyzes the outbox
// tables that autovacuum's rule says are due. Stop it with the returned func,
// which reports how many times it ran each.
type autovacuum struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	vacuums  map[string]int
	analyzes map[string]int
	err      error
}

func startAutovacuum(ctx context.Context, pool *pgxpool.Pool, naptime time.Duration, log *slog.Logger) *autovacuum {
	ctx, cancel := context.WithCancel(ctx)
	a := &autovacuum{cancel: cancel, vacuums: map[string]int{}, analyzes: map[string]int{}}
	a.wg.Go(func() {
		t := time.NewTicker(naptime)
		defer t.Stop()
		for {
			if err := a.pass(ctx, pool, true); err != nil && ctx.Err() == nil {
				log.Warn("autovacuum stand-in failed", "error", err)
				a.mu.Lock()
				a.err = err
				a.mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	})
	return a
}

// pass runs one round. throttled applies autovacuum's default cost-based
// delay (autovacuum_vacuum_cost_delay=2ms, vacuum_cost_limit=200), so the
// stand-in disturbs the workload no more than the daemon would.
func (a *autovacuum) pass(ctx context.Context, pool *pgxpool.Pool, throttled bool) error {
	type due struct {
		table            string
		vacuum, analyzes bool
	}
	rows, err := pool.Query(ctx, autovacuumSQL)
	if err != nil {
		return err
	}
	var work []due
	for rows.Next() {
		var d due
		if err := rows.Scan(&d.table, &d.vacuum, &d.analyzes); err != nil {
			rows.Close()
			return err
		}
		work = append(work, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	delay := "0"
	if throttled {
		delay = "2ms"
	}
	if _, err := conn.Exec(ctx, "SELECT set_config('vacuum_cost_delay', $1, false), set_config('vacuum_cost_limit', '200', false)", delay); err != nil {
		return err
	}
	for _, d := range work {
		var stmt string
		switch {
		case d.vacuum && d.analyzes:
			stmt = "VACUUM (ANALYZE) " + d.table
		case d.vacuum:
			stmt = "VACUUM " + d.table
		case d.analyzes:
			stmt = "ANALYZE " + d.table
		default:
			continue
		}
		if _, err := conn.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("%s: %w", stmt, err)
		}
		a.mu.Lock()
		if d.vacuum {
			a.vacuums[d.table]++
		}
		if d.analyzes {
			a.analyzes[d.table]++
		}
		a.mu.Unlock()
	}
	return nil
}

// stop ends the stand-in and returns what it did.
func (a *autovacuum) stop() (map[string]any, error) {
	a.cancel()
	a.wg.Wait()
	a.mu.Lock()
	defer a.mu.Unlock()
	return map[string]any{"vacuums": a.vacuums, "analyzes": a.analyzes}, a.err
}

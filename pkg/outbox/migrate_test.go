package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// nextColumn is the migration of a next version of the package: a column
// (a table lock) and an index (built concurrently on an existing table).
const nextColumn = `
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS note text;

CREATE INDEX IF NOT EXISTS outbox_note ON outbox (note);
`

// schemaNextPool is a fresh schema holding the tables of that next version,
// created from its Schema.
func schemaNextPool(t *testing.T, next string) *pgxpool.Pool {
	t.Helper()
	fresh := newSchemaPool(t)
	if _, err := fresh.Exec(context.Background(), outbox.SchemaNext(next)); err != nil {
		t.Fatal(err)
	}
	return fresh
}

// CheckSchema tells a schema that is missing from one that an older Migrate
// created, from one too new for this binary, and accepts what Migrate creates
// today.
func TestCheckSchema(t *testing.T) {
	t.Parallel()
	pool := newSchemaPool(t)
	ctx := context.Background()

	err := outbox.CheckSchema(ctx, pool)
	if !errors.Is(err, outbox.ErrSchemaMissing) || !strings.Contains(err.Error(), "Migrate") {
		t.Fatalf("empty schema: %v, want ErrSchemaMissing telling to run Migrate", err)
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		t.Fatalf("after Migrate: %v", err)
	}

	// A binary of the next version calls this schema outdated.
	if err := outbox.CheckSchemaNext(ctx, pool, nextColumn); !errors.Is(err, outbox.ErrSchemaOutdated) {
		t.Fatalf("CheckSchema of the next version: %v, want ErrSchemaOutdated", err)
	}

	next := outbox.SchemaVersion + 1
	for marker, wantErr := range map[string]error{
		"NULL":                      outbox.ErrSchemaOutdated, // not migrated to the end
		"'pkg/outbox schema 1'":     outbox.ErrSchemaOutdated, // no oldest binary: not a marker Migrate writes
		"'someone else''s comment'": outbox.ErrSchemaOutdated,
		"'pkg/outbox schema two'":   outbox.ErrSchemaOutdated,
		fmt.Sprintf("'pkg/outbox schema %d; binaries of schema 1 or later'", outbox.SchemaVersion-1):      outbox.ErrSchemaOutdated,
		fmt.Sprintf("'pkg/outbox schema %d; binaries of schema %d or later'", next, outbox.SchemaVersion): nil, // a later schema this binary may run against
		fmt.Sprintf("'pkg/outbox schema %d; binaries of schema %d or later'", next, next):                 outbox.ErrSchemaTooNew,
	} {
		if _, err := pool.Exec(ctx, "COMMENT ON TABLE outbox IS "+marker); err != nil {
			t.Fatal(err)
		}
		err := outbox.CheckSchema(ctx, pool)
		switch {
		case !errors.Is(err, wantErr):
			t.Errorf("marker %s: CheckSchema = %v, want %v", marker, err, wantErr)
		case wantErr == outbox.ErrSchemaOutdated && !strings.Contains(err.Error(), "Migrate"):
			t.Errorf("marker %s: %v does not say to run Migrate", marker, err)
		case wantErr == outbox.ErrSchemaTooNew && !strings.Contains(err.Error(), "newer binary"):
			t.Errorf("marker %s: %v does not say to deploy a newer binary", marker, err)
		}
		if wantErr == outbox.ErrSchemaOutdated {
			continue
		}
		// Migrate leaves a newer schema alone, whether or not it may run.
		if err := outbox.Migrate(ctx, pool); !errors.Is(err, wantErr) {
			t.Errorf("marker %s: Migrate = %v, want %v", marker, err, wantErr)
		}
		var comment string
		if err := pool.QueryRow(ctx, "SELECT obj_description('outbox'::regclass, 'pg_class')").Scan(&comment); err != nil {
			t.Fatal(err)
		}
		if "'"+comment+"'" != marker {
			t.Errorf("Migrate changed the newer marker %s to %q", marker, comment)
		}
	}
	if _, err := pool.Exec(ctx, "COMMENT ON TABLE outbox IS NULL"); err != nil {
		t.Fatal(err)
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		t.Fatalf("after migrating an outdated schema: %v", err)
	}
}

// CheckSchema reads the catalog only: it answers while another transaction
// holds the strongest lock on the outbox table, so it can never queue writers
// behind it, as DDL does.
func TestCheckSchemaTakesNoLockOnTheTable(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	lockTables(t, pool)
	// A hang, not a slow answer, is the failure: the bound only ends the test.
	cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := outbox.CheckSchema(cctx, pool); err != nil {
		t.Fatalf("CheckSchema with the tables locked: %v", err)
	}
}

// Migrate on an up-to-date schema reads the catalog and changes nothing, so
// it can run at every start: it answers while another transaction holds the
// strongest lock on every outbox table.
func TestMigrateUpToDateTakesNoLock(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	lockTables(t, pool)
	cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := outbox.Migrate(cctx, pool); err != nil {
		t.Fatalf("Migrate of an up-to-date schema with the tables locked: %v", err)
	}
}

// lockTables holds ACCESS EXCLUSIVE on the outbox tables until the test ends.
func lockTables(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	if _, err := tx.Exec(ctx, "LOCK TABLE outbox, outbox_aggregates, outbox_published, outbox_discarded IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
}

// logWatch is a slog handler that records every message with its attributes
// as text, and lets a test wait for one.
type logWatch struct {
	mu      sync.Mutex
	lines   []string
	changed chan struct{}
}

func newLogWatch() *logWatch { return &logWatch{changed: make(chan struct{})} }

func (h *logWatch) Enabled(context.Context, slog.Level) bool { return true }
func (h *logWatch) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *logWatch) WithGroup(string) slog.Handler            { return h }
func (h *logWatch) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lines = append(h.lines, b.String())
	close(h.changed)
	h.changed = make(chan struct{})
	return nil
}

// count returns how many lines contain every one of parts.
func (h *logWatch) count(parts ...string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, l := range h.lines {
		if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(l, p) }) {
			n++
		}
	}
	return n
}

// log writes the lines to the test's log under -v.
func (h *logWatch) log(t *testing.T) {
	if !testing.Verbose() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, l := range h.lines {
		t.Log(l)
	}
}

// waitCount waits until at least n lines contain every one of parts. It
// fails the test at once if one of as stopped answering meanwhile.
func (h *logWatch) waitCount(t *testing.T, timeout time.Duration, as []*answering, n int, parts ...string) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		h.mu.Lock()
		changed := h.changed
		h.mu.Unlock()
		for _, a := range as {
			if err := a.failed(); err != nil {
				t.Fatal(err)
			}
		}
		if h.count(parts...) >= n {
			return
		}
		select {
		case <-changed:
		case <-tick.C:
		case <-deadline.C:
			h.mu.Lock()
			defer h.mu.Unlock()
			t.Fatalf("timed out after %v waiting for %d log lines with %q; logged:\n%s", timeout, n, parts, strings.Join(h.lines, "\n"))
		}
	}
}

// answerBound is how long one call of an answering loop may take. The
// transactions Migrate waits behind stay open far longer than this (until the
// test ends them), so a call queued behind Migrate's lock fails it; Migrate's
// own waits last a lock_timeout (100 ms) at a time. A call blocked behind the
// lock stays blocked until the test ends the transaction, which it does only
// after the calls answered, so any bound shorter than waitAnswers' deadline
// catches it; 15 s leaves room for a loaded machine (3 s did not: the relay's
// round trip took longer on CI under a load of 13).
const answerBound = 15 * time.Second

// answering runs op in a loop until stop, each call bounded by answerBound,
// and counts the calls that answered; the first failure or overrun is kept.
type answering struct {
	calls atomic.Int64
	mu    sync.Mutex
	err   error
}

func (a *answering) run(stop <-chan struct{}, what string, op func(context.Context) error) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), answerBound)
		err := op(ctx)
		cancel()
		if err != nil {
			a.mu.Lock()
			if a.err == nil {
				a.err = fmt.Errorf("%s did not answer within %v (%v): %w", what, answerBound, time.Since(start), err)
			}
			a.mu.Unlock()
			return
		}
		a.calls.Add(1)
		time.Sleep(5 * time.Millisecond)
	}
}

func (a *answering) failed() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.err
}

// waitAnswers waits until each of as has answered n more calls than it had,
// failing on the first that stops answering.
func waitAnswers(t *testing.T, n int64, as ...*answering) {
	t.Helper()
	base := make([]int64, len(as))
	for i, a := range as {
		base[i] = a.calls.Load()
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		done := true
		for i, a := range as {
			if err := a.failed(); err != nil {
				t.Fatal(err)
			}
			if a.calls.Load() < base[i]+n {
				done = false
			}
		}
		if done {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("readers and writers stopped answering while Migrate ran")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The upgrade to a next version runs beside the business: a writer's
// transaction left open on the outbox keeps Migrate from adding its column,
// but Migrate
// waits for it only a lock_timeout at a time and logs who holds the table, so
// readers and other writers of the outbox go on answering (each call within
// answerBound);
// then the index of the new version is built concurrently while an unrelated
// old transaction holds it back, and they, and a relay of the version before,
// still answer. Once both transactions end, Migrate finishes, and the schema
// is the one the next version's Schema describes.
func TestMigrateUpgradeBesideOpenTransactionsKeepsTheOutboxAnswering(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	enqueue(t, pool, msg("before", "order.created"))

	// The open writer: an enqueue whose transaction has not ended.
	writer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Rollback(ctx) //nolint:errcheck // committed below
	if err := outbox.Enqueue(ctx, writer, msg("open", "order.created")); err != nil {
		t.Fatal(err)
	}
	writerPID := backendPID(t, writer)

	// An old transaction elsewhere, which a concurrent index build must outlive.
	other, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := other.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"); err != nil {
		t.Fatal(err)
	}
	otherPID := backendPID(t, other)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	defer func() { close(stop); wg.Wait() }()
	var reader, writers answering
	admin := outboxadmin.New(pool)
	wg.Go(func() {
		reader.run(stop, "Admin.Status", func(ctx context.Context) error {
			_, err := admin.Status(ctx)
			return err
		})
	})
	var n atomic.Int64
	wg.Go(func() {
		writers.run(stop, "Enqueue", func(ctx context.Context) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return outbox.Enqueue(ctx, tx, msg(fmt.Sprintf("w-%d", n.Add(1)), "order.created"))
			})
		})
	})
	waitAnswers(t, 5, &reader, &writers)

	logs := newLogWatch()
	migrated := make(chan error, 1)
	go func() {
		migrated <- outbox.MigrateNext(ctx, pool, outbox.MigrateConfig{Logger: slog.New(logs)}, nextColumn)
	}()

	// Migrate retries the column behind the open writer, naming it.
	logs.waitCount(t, 60*time.Second, []*answering{&reader, &writers}, 3, "lock not granted", "table outbox", fmt.Sprintf("pid %d ", writerPID))
	waitAnswers(t, 10, &reader, &writers)
	select {
	case err := <-migrated:
		t.Fatalf("Migrate returned while the writer held the table: %v", err)
	default:
	}
	if err := writer.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// The index build waits for the old transaction, and says so. The
	// column is there by now: a relay runs, and it too goes on answering:
	// each event enqueued is published within answerBound.
	logs.waitCount(t, 60*time.Second, []*answering{&reader, &writers}, 1, "waits for older transactions", fmt.Sprintf("pid %d ", otherPID))
	pub := &memPublisher{}
	cfg := fastConfig(t)
	relay := startRelay(t, pool, pub, cfg)
	var relayed answering
	wg.Go(func() {
		relayed.run(stop, "the relay", func(ctx context.Context) error {
			var e []outbox.Enqueued
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var err error
				e, err = new(outbox.Writer).Enqueue(ctx, tx, msg(fmt.Sprintf("r-%d", n.Add(1)), "order.created"))
				return err
			}); err != nil {
				return err
			}
			relay.Wake()
			for {
				if slices.ContainsFunc(pub.Snapshot(), func(p outbox.Envelope) bool { return p.ID == e[0].ID }) {
					return nil
				}
				select {
				case <-ctx.Done():
					return fmt.Errorf("event %d not published: %w", e[0].ID, ctx.Err())
				case <-time.After(5 * time.Millisecond):
				}
			}
		})
	})
	waitAnswers(t, 10, &reader, &writers, &relayed)
	select {
	case err := <-migrated:
		t.Fatalf("Migrate returned while the index build waited: %v", err)
	default:
	}
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-migrated:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Migrate did not finish once the transactions ended")
	}
	waitAnswers(t, 3, &reader, &writers, &relayed)
	logs.log(t)
	if err := outbox.CheckSchemaNext(ctx, pool, nextColumn); err != nil {
		t.Fatalf("after the upgrade: %v", err)
	}
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		t.Fatalf("the binaries of the version before refuse the upgraded schema: %v", err)
	}
	if got, want := catalog(t, pool), catalog(t, schemaNextPool(t, nextColumn)); !slices.Equal(got, want) {
		t.Fatalf("the upgraded schema differs from Schema:\nupgraded: %q\nSchema:   %q", got, want)
	}
}

func backendPID(t *testing.T, tx pgx.Tx) int {
	t.Helper()
	var pid int
	if err := tx.QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// catalog describes the outbox tables of pool's schema: columns, indexes and
// their validity, storage options, the version marker.
func catalog(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
SELECT c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod) || ' ' || a.attnotnull
       || ' ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT regexp_replace(pg_get_indexdef(i.indexrelid), ' ON \S+\.', ' ON ') || ' valid=' || i.indisvalid
FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
WHERE c.relnamespace = current_schema()::regnamespace
UNION ALL
SELECT relname || ' ' || coalesce(reloptions::text, '') || ' ' || coalesce(obj_description(oid, 'pg_class'), '')
FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relkind = 'r'
ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// An index build that was interrupted leaves an INVALID index under the
// index's name, which CREATE INDEX IF NOT EXISTS takes for the index: Migrate
// drops it and builds the real one.
func TestMigrateRebuildsAnInvalidIndex(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	enqueue(t, pool, msg("a", "order.created"), msg("a", "order.cancelled"), msg("b", "order.created"), msg("b", "order.cancelled"))
	// A build that fails halfway, as a cancelled or killed one does, under
	// the name of an index of the schema.
	if _, err := pool.Exec(ctx, "DROP INDEX outbox_dead_lettered"); err != nil {
		t.Fatal(err)
	}
	_, err := pool.Exec(ctx, "CREATE UNIQUE INDEX CONCURRENTLY outbox_dead_lettered ON outbox (event_type) WHERE NOT blocked", pgx.QueryExecModeSimpleProtocol)
	if err == nil {
		t.Fatal("the planted build did not fail")
	}
	var valid bool
	if err := pool.QueryRow(ctx, "SELECT indisvalid FROM pg_index WHERE indexrelid = 'outbox_dead_lettered'::regclass").Scan(&valid); err != nil || valid {
		t.Fatalf("no INVALID index planted: valid=%v, %v", valid, err)
	}

	logs := newLogWatch()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Go(func() { errs[i] = outbox.MigrateWithConfig(ctx, pool, outbox.MigrateConfig{Logger: slog.New(logs)}) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	if logs.count("INVALID index", "outbox_dead_lettered") == 0 {
		t.Error("nothing logged about the INVALID index")
	}
	fresh := newTestPool(t)
	if got, want := catalog(t, pool), catalog(t, fresh); !slices.Equal(got, want) {
		t.Fatalf("after the repair the schema differs from a fresh one:\nrepaired: %q\nfresh:    %q", got, want)
	}
}

// Schema cut into statements is what Migrate runs: every statement of every
// migration is one Migrate knows how to check in the catalog, and Schema
// ends with the version marker, naming SchemaVersion and the oldest binary's
// version, no later than SchemaVersion.
func TestSchemaEndsWithItsVersionMarker(t *testing.T) {
	t.Parallel()
	m := regexp.MustCompile(`COMMENT ON TABLE outbox IS 'pkg/outbox schema (\d+); binaries of schema (\d+) or later';$`).
		FindStringSubmatch(strings.TrimSpace(outbox.Schema()))
	if m == nil {
		t.Fatal("Schema does not end with its version marker")
	}
	if v, _ := strconv.Atoi(m[1]); v != outbox.SchemaVersion {
		t.Fatalf("Schema's marker names schema %d, want SchemaVersion %d", v, outbox.SchemaVersion)
	}
	if oldest, _ := strconv.Atoi(m[2]); oldest < 1 || oldest > outbox.SchemaVersion {
		t.Fatalf("Schema's marker lets binaries of schema %d run, want 1 to SchemaVersion %d", oldest, outbox.SchemaVersion)
	}
	if err := outbox.PlanError(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{
		"CREATE TABLE IF NOT EXISTS t (a int);\nUPDATE t SET a = 1;\n",
		"CREATE TABLE IF NOT EXISTS t (a int);\nCREATE INDEX IF NOT EXISTS i ON t (a)\n",
		"-- nothing\n",
	} {
		if err := outbox.ParseSchema(bad); err == nil {
			t.Errorf("ParseSchema accepted %.60q...", bad)
		}
	}
}

// nextDrop is a next version that drops an index the first one did not
// have, such as one an operator added by hand.
const nextDrop = `
DROP INDEX IF EXISTS outbox_by_hand;
`

// A next version that drops an index drops it concurrently, beside an open
// writer; the result is what the next version's Schema describes.
func TestMigrateNextVersionDropsAnIndexConcurrently(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE INDEX outbox_by_hand ON outbox (event_type)`); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, msg("a", "order.created"))
	writer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := writer.Exec(ctx, "SELECT count(*) FROM outbox"); err != nil {
		t.Fatal(err)
	}
	migrated := make(chan error, 1)
	go func() { migrated <- outbox.MigrateNext(ctx, pool, outbox.MigrateConfig{}, nextDrop) }()
	// The drop waits for the writer's transaction.
	waitFor(t, "the concurrent drop waiting for the writer", 60*time.Second, func() (bool, error) {
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE query LIKE 'DROP INDEX CONCURRENTLY%outbox_by_hand%' AND wait_event_type = 'Lock')`).Scan(&waiting)
		return waiting, err
	})
	select {
	case err := <-migrated:
		t.Fatalf("Migrate returned while the writer held the table: %v", err)
	default:
	}
	if err := writer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-migrated:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Migrate did not finish")
	}
	var gone bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass('outbox_by_hand') IS NULL").Scan(&gone); err != nil || !gone {
		t.Fatalf("index outbox_by_hand left: %v", err)
	}
	if got, want := catalog(t, pool), catalog(t, schemaNextPool(t, nextDrop)); !slices.Equal(got, want) {
		t.Fatalf("the upgraded schema differs from Schema:\nupgraded: %q\nSchema:   %q", got, want)
	}
	if err := outbox.CheckSchemaNext(ctx, pool, nextDrop); err != nil {
		t.Fatal(err)
	}
}

// reloptions returns the storage options of table, sorted.
func reloptions(t *testing.T, pool *pgxpool.Pool, table string) []string {
	t.Helper()
	var opts []string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass($1)`,
		table).Scan(&opts); err != nil {
		t.Fatal(err)
	}
	slices.Sort(opts)
	return opts
}

// Storage options a DBA tuned on the outbox tables survive a later Migrate,
// which every process may run at start: Migrate sets only the options of the
// schema a table lacks (one reset, here), and leaves the others as they are.
func TestMigrateKeepsTheStorageOptionsADBATuned(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	for _, q := range []string{
		`ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, autovacuum_enabled = false)`,
		`ALTER TABLE outbox RESET (autovacuum_analyze_threshold)`,
		`ALTER TABLE outbox_aggregates SET (fillfactor = 70)`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	for table, want := range map[string][]string{
		"outbox": {
			"autovacuum_analyze_scale_factor=0", "autovacuum_analyze_threshold=5000", // put back: it was missing
			"autovacuum_enabled=false", "autovacuum_vacuum_insert_scale_factor=0", "autovacuum_vacuum_insert_threshold=5000",
			"autovacuum_vacuum_scale_factor=0.01", "autovacuum_vacuum_threshold=1000", "fillfactor=100",
		},
		"outbox_aggregates": {"fillfactor=70"},
	} {
		if got := reloptions(t, pool, table); !slices.Equal(got, want) {
			t.Errorf("%s after Migrate: %q, want %q", table, got, want)
		}
	}
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		t.Fatal(err)
	}
}

// nextPublishedIndex is a next version that adds an index on
// outbox_published, which the relay writes to all the time.
const nextPublishedIndex = `
CREATE INDEX IF NOT EXISTS outbox_published_event_type
    ON outbox_published (event_type, aggregate_type);
`

// A next version's index on outbox_published is built concurrently on the
// existing table, beside a relay of the version before that keeps moving
// rows into it and a reader of the table in an open transaction, and the
// result is what the next version's Schema describes.
func TestMigrateNextVersionBuildsAnIndexOnPublishedConcurrently(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at, attempts)
SELECT g, 'order', 'old-' || g, 1, 'order.created', '{}', '{}', now(), 1 FROM generate_series(1, 1000) g;
ALTER TABLE outbox ALTER COLUMN id RESTART WITH 1001`); err != nil {
		t.Fatal(err)
	}
	// A reader of outbox_published in an open transaction, whose snapshot
	// holds the concurrent build back (and not the relay).
	reader, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := reader.Exec(ctx, "SELECT count(*) FROM outbox_published"); err != nil {
		t.Fatal(err)
	}

	logs := newLogWatch()
	migrated := make(chan error, 1)
	go func() {
		migrated <- outbox.MigrateNext(ctx, pool, outbox.MigrateConfig{Logger: slog.New(logs)}, nextPublishedIndex)
	}()
	logs.waitCount(t, 60*time.Second, nil, 1, "waits for older transactions", "outbox_published")
	pub := &memPublisher{}
	relay := startRelay(t, pool, pub, fastConfig(t))
	for i := range 20 {
		enqueue(t, pool, msg(fmt.Sprintf("during-%d", i), "order.created"))
	}
	relay.Wake()
	waitFor(t, "the events published while the index is built", 20*time.Second, outboxEmpty(pool))
	select {
	case err := <-migrated:
		t.Fatalf("Migrate returned while the reader held the build back: %v", err)
	default:
	}
	if err := reader.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-migrated:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Migrate did not finish once the reader ended")
	}
	if logs.count("building an index concurrently", "outbox_published_event_type") == 0 {
		logs.log(t)
		t.Error("the index was not built concurrently")
	}
	if err := outbox.CheckSchemaNext(ctx, pool, nextPublishedIndex); err != nil {
		t.Fatal(err)
	}
	if got, want := catalog(t, pool), catalog(t, schemaNextPool(t, nextPublishedIndex)); !slices.Equal(got, want) {
		t.Fatalf("the upgraded schema differs from Schema:\nupgraded: %q\nSchema:   %q", got, want)
	}
	h, err := outboxadmin.New(pool).History(ctx, "order", "during-7")
	if err != nil || len(h) != 1 || h[0].State != outbox.EventPublished {
		t.Fatalf("History after the upgrade: %v, %+v", err, h)
	}
}

package outbox

import (
	"cmp"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
)

// schemaV1 is version 1 of the schema: the tables and indexes.
//
//go:embed schema.sql
var schemaV1 string

// migration is one version of the schema: the statements that bring the
// version before it to this one.
type migration struct {
	version int
	// sql holds statements of the kinds parseStmt knows (see schema.sql),
	// each idempotent.
	sql string
	// breaking says binaries built for an earlier version must not run
	// against this one (they would mishandle its rows, or it theirs):
	// CheckSchema in them refuses to start. A step that adds a nullable
	// column or an index is not breaking.
	breaking bool
}

// migrations are the versions of the schema, in order, numbered from 1
// without gaps. To change the schema, append a step and never edit one a
// database may have run: Migrate brings a database to the last version,
// running what it lacks of every step; CheckSchema refuses a database behind
// it. nextMigrations is empty unless a build tag adds the chaos suite's next
// version (migrate_next.go).
func migrations() []migration {
	return append([]migration{
		{version: 1, sql: schemaV1},
	}, nextMigrations...)
}

// Schema returns the SQL that creates the outbox tables and indexes at the
// current version: every migration's statements, then a COMMENT on the
// outbox table recording the version, which [CheckSchema] reads. Every
// statement is idempotent: give it to your own migration tool if you do not
// want [Migrate] to run it. Run as is on a live database, it locks the outbox
// table even when it changes nothing (queueing its readers and writers behind
// any open transaction that touched it) and sets back storage options a DBA
// tuned; Migrate does neither.
func Schema() string { return schemaOf(migrations()) }

// schemaOf is the SQL of migs, then their marker.
func schemaOf(migs []migration) string {
	var b strings.Builder
	for _, m := range migs {
		b.WriteString(strings.TrimSpace(m.sql))
		b.WriteString("\n\n")
	}
	b.WriteString("COMMENT ON TABLE outbox IS '" + markerOf(migs) + "';\n")
	return b.String()
}

// versionsOf returns the version migs bring a schema to, and the oldest
// version of a binary that may run against it: that of the last breaking
// step, or 1.
func versionsOf(migs []migration) (version, oldest int) {
	oldest = 1
	for _, m := range migs {
		version = m.version
		if m.breaking {
			oldest = m.version
		}
	}
	return version, oldest
}

// markerOf is the comment the outbox table carries at the version of migs.
func markerOf(migs []migration) string {
	v, oldest := versionsOf(migs)
	return fmt.Sprintf("%s%d; binaries of schema %d or later", schemaMarker, v, oldest)
}

// schemaMarker is the start of the comment Schema puts on the outbox table.
const schemaMarker = "pkg/outbox schema "

// markerRE reads the comment: the version, and the oldest binary's version.
var markerRE = regexp.MustCompile(`^pkg/outbox schema (\d+); binaries of schema (\d+) or later$`)

var (
	// ErrSchemaMissing means the outbox table is not in the connection's
	// search_path: Migrate (or Schema) has not run on this database.
	ErrSchemaMissing = errors.New("outbox: schema missing")
	// ErrSchemaOutdated means the outbox schema is at an earlier version
	// than this binary's: run Migrate (or Schema) again.
	ErrSchemaOutdated = errors.New("outbox: schema outdated")
	// ErrSchemaTooNew means the outbox schema was migrated by a later version
	// of this package that older binaries must not run against (it would
	// mishandle their rows, or they would mishandle its): upgrade the binary.
	// Migrate changes nothing then.
	ErrSchemaTooNew = errors.New("outbox: schema too new for this binary")
)

// migrateLockClass and the hash of the schema's name are the advisory lock
// that serialises the transactional steps of concurrent Migrate calls on one
// schema: CREATE ... IF NOT EXISTS is not safe against itself when two
// processes start at the same moment.
const migrateLockClass int32 = 0x6f7574 // "out"

// DefaultMigrateLockTimeout is the default of MigrateConfig.LockTimeout.
const DefaultMigrateLockTimeout = 100 * time.Millisecond

// MigrateConfig configures MigrateWithConfig.
type MigrateConfig struct {
	// LockTimeout bounds each wait for a lock on an outbox table (the
	// lock_timeout of each step's transaction). While a step waits for a
	// lock, every later reader and writer of that table waits behind it, so
	// the wait is kept short: when it times out, Migrate logs the sessions
	// holding the table (pg_locks, pg_stat_activity) and tries again after a
	// backoff (100ms doubling to 10s, with jitter), until ctx ends. Default
	// DefaultMigrateLockTimeout (100ms).
	LockTimeout time.Duration
	// Logger receives what Migrate changes and what it waits for. Default
	// slog.Default().
	Logger *slog.Logger
}

// Migrate brings the outbox tables in the database's current schema (the
// connection's search_path) to the current version, creating them if they do not
// exist, with the defaults of MigrateConfig. See MigrateWithConfig.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	return MigrateWithConfig(ctx, pool, MigrateConfig{})
}

// MigrateWithConfig brings the outbox tables to the current version, safely on a
// live database and from several processes at once:
//
//   - It first reads the catalog, which locks no table: on an up-to-date
//     schema it returns without taking any other lock.
//   - Each missing column, table or setting is added in a transaction with a
//     lock_timeout of cfg.LockTimeout, retried with backoff (logging who holds
//     the lock) until ctx ends.
//   - Storage options (autovacuum thresholds, fillfactor) are set only where
//     the table lacks them: a DBA's values stay.
//   - Missing indexes of existing tables are built CONCURRENTLY; one left
//     INVALID by an interrupted build is dropped and built again.
//   - The version marker is written last, so an interrupted Migrate leaves a
//     schema [CheckSchema] calls outdated, and the next Migrate finishes it.
//
// A schema newer than this binary's is left alone: Migrate returns nil if
// this binary may run against it, and an error wrapping [ErrSchemaTooNew]
// otherwise. It uses up to two of pool's connections at once.
func MigrateWithConfig(ctx context.Context, pool *pgxpool.Pool, cfg MigrateConfig) error {
	p, err := plan()
	if err != nil {
		return fmt.Errorf("outbox migrate: %w", err)
	}
	return migrateWith(ctx, pool, cfg, p)
}

// migrateWith is MigrateWithConfig to p.
func migrateWith(ctx context.Context, pool *pgxpool.Pool, cfg MigrateConfig, p schemaPlan) error {
	if cfg.LockTimeout < 0 {
		return fmt.Errorf("outbox migrate: LockTimeout %v is negative", cfg.LockTimeout)
	}
	cfg.LockTimeout = cmp.Or(cfg.LockTimeout, DefaultMigrateLockTimeout)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m := &migrator{pool: pool, cfg: cfg, log: cfg.Logger, plan: p, verbose: slog.LevelInfo}
	if err := m.run(ctx); err != nil {
		return fmt.Errorf("outbox migrate: %w", err)
	}
	return nil
}

// stmtKind is what a statement of a migration does, which tells how to find
// out from the catalog whether it is in effect, and how to run it.
type stmtKind int

const (
	kindTable     stmtKind = iota // CREATE TABLE IF NOT EXISTS
	kindColumn                    // ALTER TABLE ... ADD COLUMN IF NOT EXISTS
	kindOptions                   // ALTER TABLE ... SET (...)
	kindIndex                     // CREATE [UNIQUE] INDEX IF NOT EXISTS
	kindDropIndex                 // DROP INDEX IF EXISTS
	kindMarker                    // COMMENT ON TABLE outbox (written by Migrate)
)

// schemaStmt is one statement of a migration.
type schemaStmt struct {
	since   int // the version of its migration
	kind    stmtKind
	sql     string
	table   string   // the table it changes
	name    string   // the column or index it adds
	options []string // "name=value" for kindOptions
}

func (s schemaStmt) String() string {
	switch s.kind {
	case kindTable:
		return "create table " + s.table
	case kindColumn:
		return "add column " + s.table + "." + s.name
	case kindOptions:
		return "set the storage options " + s.table + " lacks"
	case kindIndex:
		return "create index " + s.name + " on " + s.table
	case kindDropIndex:
		return "drop index " + s.name
	default:
		return "record the schema version: " + s.name
	}
}

var (
	tableRE   = regexp.MustCompile(`^CREATE TABLE IF NOT EXISTS (\w+) \(`)
	columnRE  = regexp.MustCompile(`^ALTER TABLE (\w+) ADD COLUMN IF NOT EXISTS (\w+) `)
	optionsRE = regexp.MustCompile(`^ALTER TABLE (\w+) SET \((.*)\);$`)
	indexRE   = regexp.MustCompile(`^CREATE (?:UNIQUE )?INDEX IF NOT EXISTS (\w+) ON (\w+) `)
	dropRE    = regexp.MustCompile(`^DROP INDEX IF EXISTS (\w+);$`)
	spacesRE  = regexp.MustCompile(`\s+`)
)

// schemaPlan is what Migrate brings a schema to: the statements of every
// migration, then the version marker.
type schemaPlan struct {
	stmts           []schemaStmt
	version, oldest int
}

// plan is migrations(), parsed once.
var plan = sync.OnceValues(func() (schemaPlan, error) { return parseMigrations(migrations()) })

// parseMigrations checks that migs are numbered from 1 without gaps and
// parses each into its statements.
func parseMigrations(migs []migration) (schemaPlan, error) {
	var p schemaPlan
	for i, m := range migs {
		if m.version != i+1 {
			return p, fmt.Errorf("migration %d is numbered %d: want 1, 2, ... without gaps", i+1, m.version)
		}
		stmts, err := parseSchema(m.sql)
		if err != nil {
			return p, fmt.Errorf("migration %d: %w", m.version, err)
		}
		for j := range stmts {
			stmts[j].since = m.version
		}
		p.stmts = append(p.stmts, stmts...)
	}
	if len(migs) == 0 {
		return p, errors.New("no migration")
	}
	p.version, p.oldest = versionsOf(migs)
	p.stmts = append(p.stmts, schemaStmt{since: p.version, kind: kindMarker, table: "outbox", name: markerOf(migs),
		sql: "COMMENT ON TABLE outbox IS '" + markerOf(migs) + "'"})
	return p, nil
}

// parseSchema cuts sql into statements (each ends with a semicolon at the end
// of a line) and recognises each. Anything else is an error: Migrate could
// not tell whether it is in effect without running it.
func parseSchema(sql string) ([]schemaStmt, error) {
	var (
		out   []schemaStmt
		chunk strings.Builder
	)
	for line := range strings.Lines(sql) {
		chunk.WriteString(line)
		if !strings.HasSuffix(strings.TrimSpace(line), ";") || strings.HasPrefix(strings.TrimSpace(line), "--") {
			continue
		}
		st, err := parseStmt(chunk.String())
		if err != nil {
			return nil, err
		}
		out = append(out, st)
		chunk.Reset()
	}
	if strings.TrimSpace(stripComments(chunk.String())) != "" {
		return nil, fmt.Errorf("unterminated statement: %.80q", chunk.String())
	}
	if len(out) == 0 {
		return nil, errors.New("no statement")
	}
	return out, nil
}

func parseStmt(text string) (schemaStmt, error) {
	st := schemaStmt{sql: strings.TrimSpace(text)}
	code := strings.TrimSpace(spacesRE.ReplaceAllString(stripComments(text), " "))
	code = strings.ReplaceAll(strings.ReplaceAll(code, "( ", "("), " )", ")")
	switch {
	case tableRE.MatchString(code):
		st.kind, st.table = kindTable, tableRE.FindStringSubmatch(code)[1]
	case columnRE.MatchString(code):
		m := columnRE.FindStringSubmatch(code)
		st.kind, st.table, st.name = kindColumn, m[1], m[2]
	case optionsRE.MatchString(code):
		m := optionsRE.FindStringSubmatch(code)
		st.kind, st.table = kindOptions, m[1]
		for opt := range strings.SplitSeq(m[2], ",") {
			k, v, ok := strings.Cut(opt, "=")
			if !ok {
				return st, fmt.Errorf("option %q of %s has no value", opt, st.table)
			}
			st.options = append(st.options, strings.TrimSpace(k)+"="+strings.TrimSpace(v))
		}
	case indexRE.MatchString(code):
		m := indexRE.FindStringSubmatch(code)
		st.kind, st.name, st.table = kindIndex, m[1], m[2]
	case dropRE.MatchString(code):
		st.kind, st.name = kindDropIndex, dropRE.FindStringSubmatch(code)[1]
	default:
		return st, fmt.Errorf("Migrate cannot tell whether this statement is in effect: %.80q", code)
	}
	return st, nil
}

func stripComments(text string) string {
	var b strings.Builder
	for line := range strings.Lines(text) {
		if i := strings.Index(line, "--"); i >= 0 {
			line = line[:i] + "\n"
		}
		b.WriteString(line)
	}
	return b.String()
}

// schemaState is what the catalog says about the outbox table's version.
type schemaState struct {
	found   bool   // the outbox table is in the search_path
	marked  bool   // its comment is a version marker
	version int    // the marker's version
	oldest  int    // the oldest binary's version the marker allows
	comment string // the comment, for errors
	path    string // the search_path, for errors
}

func readSchemaState(ctx context.Context, db DB) (schemaState, error) {
	var s schemaState
	err := db.QueryRow(ctx, `SELECT to_regclass('outbox') IS NOT NULL,
		coalesce(obj_description(to_regclass('outbox'), 'pg_class'), ''),
		current_setting('search_path')`).Scan(&s.found, &s.comment, &s.path)
	if err != nil {
		return s, err
	}
	if m := markerRE.FindStringSubmatch(s.comment); m != nil {
		s.marked = true
		s.version, _ = strconv.Atoi(m[1])
		s.oldest, _ = strconv.Atoi(m[2])
	}
	return s, nil
}

// check is CheckSchema's verdict on s, for a binary whose schema is at
// version.
func (s schemaState) check(version int) error {
	switch {
	case !s.found:
		return fmt.Errorf("%w: no outbox table in search_path %q (Migrate or Schema creates it)", ErrSchemaMissing, s.path)
	case !s.marked:
		return fmt.Errorf("%w: the outbox table has no schema version (comment %q), want %d (Migrate or Schema updates it)", ErrSchemaOutdated, s.comment, version)
	case s.version < version:
		return fmt.Errorf("%w: the outbox table is at schema version %d, want %d (Migrate or Schema updates it)", ErrSchemaOutdated, s.version, version)
	case s.oldest > version:
		return fmt.Errorf("%w: the outbox table is at schema version %d, which binaries built for schema %d must not use (it needs %d or later): deploy a newer binary",
			ErrSchemaTooNew, s.version, version, s.oldest)
	}
	return nil
}

// DB is what CheckSchema and package outboxadmin need to run their
// statements: *pgxpool.Pool, *pgx.Conn and pgx.Tx all satisfy it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Begin(ctx context.Context) (pgx.Tx, error)
}

// CheckSchema reports whether the outbox tables are there, at a version this
// binary can run against. It reads the catalog only and takes no lock on the
// tables: call it when a process starts. It returns an error wrapping
// [ErrSchemaMissing] or [ErrSchemaOutdated] (run [Migrate]), [ErrSchemaTooNew]
// (upgrade the binary), or the query's error.
func CheckSchema(ctx context.Context, db DB) error {
	s, err := readSchemaState(ctx, db)
	if err != nil {
		return fmt.Errorf("outbox check schema: %w", err)
	}
	return s.check(checkVersion(migrations()))
}

// checkVersion is the version CheckSchema wants for migs.
func checkVersion(migs []migration) int {
	v, _ := versionsOf(migs)
	return v
}

// migrator runs one Migrate.
type migrator struct {
	pool    *pgxpool.Pool
	cfg     MigrateConfig
	log     *slog.Logger
	plan    schemaPlan
	verbose slog.Level // of the per-step logs: Info, or Debug when creating everything
}

func (m *migrator) run(ctx context.Context) error {
	state, err := readSchemaState(ctx, m.pool)
	if err != nil {
		return fmt.Errorf("read schema version: %w", err)
	}
	if state.marked && state.version > m.plan.version {
		if err := state.check(m.plan.version); err != nil {
			return err
		}
		m.log.InfoContext(ctx, "outbox migrate: the schema is newer than this binary's; leaving it as it is",
			slog.Int("schema_version", state.version), slog.Int("binary_schema_version", m.plan.version))
		return nil
	}
	applied, err := m.applied(ctx, m.pool, m.plan.stmts)
	if err != nil {
		return err
	}
	var todo []schemaStmt
	existed := map[string]bool{}
	for i, st := range m.plan.stmts {
		if st.kind == kindTable && applied[i] {
			existed[st.table] = true
		}
		if !applied[i] {
			todo = append(todo, st)
		}
	}
	if len(todo) == 0 {
		return nil
	}
	if !state.found {
		m.log.InfoContext(ctx, "outbox migrate: creating the outbox tables", slog.Int("schema_version", m.plan.version))
		m.verbose = slog.LevelDebug
	} else {
		m.log.InfoContext(ctx, "outbox migrate: bringing the schema to its current version",
			slog.Int("from_version", state.version), slog.Int("to_version", m.plan.version), slog.Int("steps", len(todo)))
	}

	// Consecutive statements run in one transaction; an index on a table
	// that existed before this Migrate is built concurrently, on its own.
	var group []schemaStmt
	flush := func() error {
		if len(group) == 0 {
			return nil
		}
		err := m.inTx(ctx, group)
		group = nil
		return err
	}
	for _, st := range todo {
		if st.kind == kindDropIndex {
			// Concurrently, alone: readers and writers go on meanwhile.
			if err := flush(); err != nil {
				return err
			}
			if err := m.dropIndex(ctx, st); err != nil {
				return err
			}
			continue
		}
		if st.kind == kindIndex && existed[st.table] {
			if err := flush(); err != nil {
				return err
			}
			if err := m.ensureIndex(ctx, st); err != nil {
				return err
			}
			continue
		}
		group = append(group, st)
	}
	if err := flush(); err != nil {
		return err
	}
	m.log.Log(ctx, m.verbose, "outbox migrate: schema up to date", slog.Int("schema_version", m.plan.version))
	return nil
}

// appliedSQL tells from the catalog alone whether a statement is in effect.
// None of these reads locks the tables they look at.
var appliedSQL = map[stmtKind]string{
	kindTable: `SELECT to_regclass($1) IS NOT NULL`,
	kindColumn: `SELECT EXISTS (SELECT 1 FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = $2 AND attnum > 0 AND NOT attisdropped)`,
	kindOptions:   `SELECT coalesce((SELECT ` + optionNamesSQL + ` FROM pg_class WHERE oid = to_regclass($1)), '{}') @> $2::text[]`,
	kindIndex:     `SELECT coalesce((` + indexStateSQL + `), 'missing') = 'valid'`,
	kindDropIndex: `SELECT to_regclass($1) IS NULL`,
	kindMarker:    `SELECT coalesce(obj_description(to_regclass($1), 'pg_class'), '') = $2`,
}

// optionNamesSQL lists the names of the storage options a pg_class row has,
// whatever their values.
const optionNamesSQL = `array(SELECT split_part(o, '=', 1) FROM unnest(reloptions) o)`

// indexStateSQL says whether index $2 of table $1 is 'valid', 'building'
// (INVALID while a build of it is in progress), 'invalid' (left by a build
// that did not finish), or missing (NULL).
const indexStateSQL = `
SELECT CASE WHEN i.indisvalid THEN 'valid'
            WHEN EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.index_relid = c.oid) THEN 'building'
            ELSE 'invalid' END
FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid
WHERE c.relname = $2 AND i.indrelid = to_regclass($1)`

// optionNames are the names of the options a kindOptions statement sets.
func (st schemaStmt) optionNames() []string {
	names := make([]string, len(st.options))
	for i, o := range st.options {
		names[i], _, _ = strings.Cut(o, "=")
	}
	return names
}

// setMissingOptions sets those of st's storage options that st.table lacks
// to the schema's values, and leaves alone the ones it has, whatever their
// values: a DBA's tuning of a table (a vacuum threshold, a fillfactor)
// survives every later Migrate. It returns the options it set.
func setMissingOptions(ctx context.Context, tx pgx.Tx, st schemaStmt) ([]string, error) {
	var have []string
	if err := tx.QueryRow(ctx, `SELECT coalesce((SELECT `+optionNamesSQL+` FROM pg_class WHERE oid = to_regclass($1)), '{}')`,
		st.table).Scan(&have); err != nil {
		return nil, fmt.Errorf("read the storage options of %s: %w", st.table, err)
	}
	var set []string
	for i, name := range st.optionNames() {
		if !slices.Contains(have, name) {
			set = append(set, st.options[i])
		}
	}
	if len(set) == 0 {
		return nil, nil
	}
	// The table and the options come from schema.sql (parseStmt admits
	// \w+ table names only).
	_, err := tx.Exec(ctx, "ALTER TABLE "+st.table+" SET ("+strings.Join(set, ", ")+")")
	return set, err
}

func (st schemaStmt) appliedArgs() []any {
	switch st.kind {
	case kindColumn, kindIndex:
		return []any{st.table, st.name}
	case kindDropIndex:
		return []any{st.name}
	case kindOptions:
		return []any{st.table, st.optionNames()}
	case kindMarker:
		return []any{st.table, st.name}
	default:
		return []any{st.table}
	}
}

// applied reads, in one round trip, which of stmts are in effect.
func (m *migrator) applied(ctx context.Context, db interface {
	SendBatch(context.Context, *pgx.Batch) pgx.BatchResults
}, stmts []schemaStmt) ([]bool, error) {
	b := &pgx.Batch{}
	out := make([]bool, len(stmts))
	for i, st := range stmts {
		b.Queue(appliedSQL[st.kind], st.appliedArgs()...).QueryRow(func(row pgx.Row) error {
			return row.Scan(&out[i])
		})
	}
	if err := db.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("read the catalog: %w", err)
	}
	return out, nil
}

// inTx runs the statements of stmts that are not in effect yet in one
// transaction, under the migration lock and a lock_timeout, and retries with
// backoff while a lock is not granted in time.
func (m *migrator) inTx(ctx context.Context, stmts []schemaStmt) error {
	for attempt := 1; ; attempt++ {
		var waitingFor string // the table being locked
		err := pgx.BeginFunc(ctx, m.pool, func(tx pgx.Tx) error {
			// Only other Migrate calls take this lock, each for one short
			// transaction: waiting for it holds nobody else up.
			if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1, hashtext(current_schema()))", migrateLockClass); err != nil {
				return fmt.Errorf("take the migration lock: %w", err)
			}
			if _, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)",
				strconv.FormatInt(m.cfg.LockTimeout.Milliseconds(), 10)+"ms"); err != nil {
				return fmt.Errorf("set lock_timeout: %w", err)
			}
			// Another Migrate may have applied some of them meanwhile.
			applied, err := m.applied(ctx, tx, stmts)
			if err != nil {
				return err
			}
			for i, st := range stmts {
				if applied[i] {
					continue
				}
				waitingFor = st.table
				if st.kind == kindOptions {
					set, err := setMissingOptions(ctx, tx, st)
					if err != nil {
						return fmt.Errorf("%s: %w", st, err)
					}
					m.log.Log(ctx, m.verbose, "outbox migrate: applied", slog.String("step", st.String()), slog.Any("options", set),
						slog.Int("since_version", st.since))
					continue
				}
				if _, err := tx.Exec(ctx, st.sql); err != nil {
					return fmt.Errorf("%s: %w", st, err)
				}
				m.log.Log(ctx, m.verbose, "outbox migrate: applied", slog.String("step", st.String()), slog.Int("since_version", st.since))
			}
			return nil
		})
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || !isLockTimeout(err) {
			return err
		}
		wait := retry.Jitter(retry.Backoff(attempt, 100*time.Millisecond, 10*time.Second))
		m.logBlockers(ctx, waitingFor, attempt, wait)
		retry.Sleep(ctx, wait)
		if ctx.Err() != nil {
			return fmt.Errorf("gave up waiting for a lock: %w", ctx.Err())
		}
	}
}

func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03" // lock_not_available
}

// holdersSQL lists the other sessions holding a lock on table $1.
const holdersSQL = `
SELECT a.pid, string_agg(l.mode, '+' ORDER BY l.mode), coalesce(a.application_name, ''), coalesce(a.state, ''),
       coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8, left(coalesce(a.query, ''), 200)
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.pid <> pg_backend_pid() AND l.locktype = 'relation' AND l.relation = to_regclass($1)
GROUP BY a.pid, a.application_name, a.state, a.xact_start, a.query
ORDER BY a.xact_start`

// logBlockers logs who held the table the timed-out step waited for.
func (m *migrator) logBlockers(ctx context.Context, table string, attempt int, retryIn time.Duration) {
	holders, err := m.sessions(ctx, holdersSQL, table)
	if err != nil {
		holders = []string{"(could not list them: " + err.Error() + ")"}
	}
	m.log.WarnContext(ctx, "outbox migrate: lock not granted within the lock timeout, retrying; readers and writers of the table were queued meanwhile for at most that long",
		slog.String("waiting_for", "a lock on table "+table), slog.Duration("lock_timeout", m.cfg.LockTimeout), slog.Int("attempt", attempt),
		slog.Duration("retry_in", retryIn), slog.Any("held_by", holders))
}

// sessions runs a query listing sessions (pid, lock mode or wait, application,
// state, transaction age in seconds, query) and formats them for a log.
func (m *migrator) sessions(ctx context.Context, sql string, args ...any) ([]string, error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rows, err := m.pool.Query(qctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var (
			pid              int32
			mode, app, state string
			age              float64
			query            string
		)
		if err := r.Scan(&pid, &mode, &app, &state, &age, &query); err != nil {
			return "", err
		}
		return fmt.Sprintf("pid %d (%s, application %q, %s, transaction open %.1fs): %s", pid, mode, app, state, age, query), nil
	})
}

// ensureIndex builds st's index concurrently, after dropping an INVALID one
// that no build is working on, or waits for another process's build.
func (m *migrator) ensureIndex(ctx context.Context, st schemaStmt) error {
	build := strings.Replace(st.sql, "INDEX IF NOT EXISTS", "INDEX CONCURRENTLY IF NOT EXISTS", 1)
	var waitLogged bool
	for attempt := 1; ; attempt++ {
		var state *string
		if err := m.pool.QueryRow(ctx, indexStateSQL, st.table, st.name).Scan(&state); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%s: read its state: %w", st, err)
		}
		var err error
		switch {
		case state != nil && *state == "valid":
			return nil
		case state != nil && *state == "building":
			if !waitLogged {
				m.log.InfoContext(ctx, "outbox migrate: another session is building the index; waiting for it", slog.String("index", st.name))
				waitLogged = true
			}
			retry.Sleep(ctx, retry.Jitter(time.Second))
			if ctx.Err() != nil {
				return fmt.Errorf("%s: %w", st, ctx.Err())
			}
			continue
		case state != nil: // invalid, and nobody builds it
			m.log.WarnContext(ctx, "outbox migrate: dropping an INVALID index left by an interrupted build, to build it again",
				slog.String("index", st.name))
			err = m.execAlone(ctx, st.table, "DROP INDEX CONCURRENTLY IF EXISTS "+m.qualified(ctx, st.table, st.name))
		default:
			m.log.InfoContext(ctx, "outbox migrate: building an index concurrently (readers and writers go on)",
				slog.String("step", st.String()), slog.Int("since_version", st.since))
			err = m.execAlone(ctx, st.table, build)
			if err == nil {
				m.log.InfoContext(ctx, "outbox migrate: applied", slog.String("step", st.String()), slog.Int("since_version", st.since))
			}
		}
		if err == nil {
			continue
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w (an INVALID index may be left: the next Migrate rebuilds it)", st, ctx.Err())
		}
		if !concurrentDDLConflict(err) {
			return fmt.Errorf("%s: %w", st, err)
		}
		// A lock timeout from the session's settings, or a collision with
		// another Migrate building or dropping the same index: look again.
		wait := retry.Jitter(retry.Backoff(attempt, 100*time.Millisecond, 10*time.Second))
		m.log.WarnContext(ctx, "outbox migrate: index build failed, retrying", slog.String("index", st.name),
			slog.Any("error", err), slog.Duration("retry_in", wait))
		retry.Sleep(ctx, wait)
	}
}

// dropIndex drops st's index concurrently, retrying a collision with
// another Migrate doing the same.
func (m *migrator) dropIndex(ctx context.Context, st schemaStmt) error {
	var table string
	err := m.pool.QueryRow(ctx, `SELECT i.indrelid::regclass::text FROM pg_index i WHERE i.indexrelid = to_regclass($1)`, st.name).Scan(&table)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // gone meanwhile
	}
	if err != nil {
		return fmt.Errorf("%s: find its table: %w", st, err)
	}
	for attempt := 1; ; attempt++ {
		err := m.execAlone(ctx, table, "DROP INDEX CONCURRENTLY IF EXISTS "+m.qualified(ctx, table, st.name))
		if err == nil {
			m.log.InfoContext(ctx, "outbox migrate: applied", slog.String("step", st.String()), slog.Int("since_version", st.since))
			return nil
		}
		if ctx.Err() != nil || !concurrentDDLConflict(err) {
			return fmt.Errorf("%s: %w", st, err)
		}
		wait := retry.Jitter(retry.Backoff(attempt, 100*time.Millisecond, 10*time.Second))
		m.log.WarnContext(ctx, "outbox migrate: index drop failed, retrying", slog.String("index", st.name),
			slog.Any("error", err), slog.Duration("retry_in", wait))
		retry.Sleep(ctx, wait)
	}
}

// concurrentDDLConflict tells the errors two sessions building or dropping
// the same index concurrently can get from each other, and a lock timeout
// from the session's own settings: a deadlock, a name taken first, a catalog
// row changed under the statement.
func concurrentDDLConflict(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return slices.Contains([]string{"55P03", "40P01", "42P07"}, pgErr.Code) ||
		pgErr.Code == "XX000" && strings.Contains(pgErr.Message, "tuple concurrently updated")
}

// qualified returns the index name qualified with its table's schema.
func (m *migrator) qualified(ctx context.Context, table, name string) string {
	var schema string
	if err := m.pool.QueryRow(ctx, `SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.oid = to_regclass($1)`, table).Scan(&schema); err != nil {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{schema, name}.Sanitize()
}

// buildWaitSQL lists what a concurrent index build on table $1 waits for:
// the sessions blocking it (older transactions it must outlive).
const buildWaitSQL = `
SELECT a.pid, 'holds back the build, ' || p.phase, coalesce(a.application_name, ''), coalesce(a.state, ''),
       coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8, left(coalesce(a.query, ''), 200)
FROM pg_stat_progress_create_index p
CROSS JOIN LATERAL unnest(pg_blocking_pids(p.pid)) AS b(pid)
JOIN pg_stat_activity a ON a.pid = b.pid
WHERE p.relid = to_regclass($1) AND p.pid <> pg_backend_pid()`

// execAlone runs a statement that must run outside a transaction (the
// simple protocol sends it alone), and meanwhile logs every few seconds the
// sessions the statement waits for.
func (m *migrator) execAlone(ctx context.Context, table, sql string) error {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(2 * time.Second)
		defer t.Stop()
		var last string
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			waits, err := m.sessions(ctx, buildWaitSQL, table)
			if err != nil || len(waits) == 0 {
				continue
			}
			if s := strings.Join(waits, "; "); s != last {
				last = s
				m.log.WarnContext(ctx, "outbox migrate: the concurrent index build waits for older transactions to end",
					slog.String("table", table), slog.Any("waiting_for", waits))
			}
		}
	})
	_, err := m.pool.Exec(ctx, sql, pgx.QueryExecModeSimpleProtocol)
	close(done)
	wg.Wait()
	return err
}

package outbox

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Schema is the SQL that creates the outbox tables and indexes. It is idempotent.
// Use it from your own migration tool if you do not want Migrate to run it. Its
// last statement records SchemaVersion as the comment of the outbox table, which
// CheckSchema reads.
//
//go:embed schema.sql
var Schema string

// migrateLockKey serialises concurrent Migrate calls: CREATE ... IF NOT EXISTS is
// not safe against itself when two processes start at the same moment.
const migrateLockKey int64 = 0x6f7574626f78 // "outbox"

// TxBeginner is what Migrate needs: *pgxpool.Pool and *pgx.Conn both satisfy it.
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate creates the outbox tables and indexes in the database's current schema
// (the connection's search_path) if they do not exist yet. It is safe to call from
// several processes at once.
func Migrate(ctx context.Context, db TxBeginner) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox migrate: begin: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit

	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLockKey); err != nil {
		return fmt.Errorf("outbox migrate: lock: %w", err)
	}
	if _, err := tx.Exec(ctx, Schema); err != nil {
		return fmt.Errorf("outbox migrate: apply schema: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("outbox migrate: commit: %w", err)
	}
	return nil
}

// SchemaVersion is the version of Schema. It changes whenever Schema does, so
// CheckSchema can tell a database that a previous version migrated.
const SchemaVersion = 3

// schemaMarker is the comment Schema puts on the outbox table.
const schemaMarker = "pkg/outbox schema "

var (
	// ErrSchemaMissing means the outbox table is not in the connection's
	// search_path: Migrate (or Schema) has not run on this database.
	ErrSchemaMissing = errors.New("outbox: schema missing")
	// ErrSchemaOutdated means the outbox table was created by an earlier
	// version of Schema: run Migrate (or Schema) again.
	ErrSchemaOutdated = errors.New("outbox: schema outdated")
)

// CheckSchema reports whether the outbox tables are there, at SchemaVersion or
// later, without changing anything: it reads the catalog only and takes no lock
// on the tables, so it never waits for, nor makes anyone wait behind, a
// transaction that writes to the outbox. (Migrate's CREATE INDEX IF NOT EXISTS
// takes a SHARE lock on outbox even when the index exists: run Migrate from a
// deployment step, and CheckSchema when a process starts.) It returns an error
// wrapping ErrSchemaMissing or ErrSchemaOutdated, or the query's error.
func CheckSchema(ctx context.Context, db DB) error {
	var (
		found   bool
		comment string
		path    string
	)
	err := db.QueryRow(ctx, `SELECT to_regclass('outbox') IS NOT NULL,
		coalesce(obj_description(to_regclass('outbox'), 'pg_class'), ''),
		current_setting('search_path')`).Scan(&found, &comment, &path)
	if err != nil {
		return fmt.Errorf("outbox check schema: %w", err)
	}
	if !found {
		return fmt.Errorf("%w: no outbox table in search_path %q (Migrate or Schema creates it)", ErrSchemaMissing, path)
	}
	v, err := strconv.Atoi(strings.TrimPrefix(comment, schemaMarker))
	if !strings.HasPrefix(comment, schemaMarker) || err != nil {
		return fmt.Errorf("%w: the outbox table has no schema version (comment %q), want %d (Migrate or Schema updates it)", ErrSchemaOutdated, comment, SchemaVersion)
	}
	if v < SchemaVersion {
		return fmt.Errorf("%w: the outbox table is at schema version %d, want %d (Migrate or Schema updates it)", ErrSchemaOutdated, v, SchemaVersion)
	}
	return nil
}

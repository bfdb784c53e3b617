package outbox

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Schema is the SQL that creates the outbox tables and indexes. It is idempotent.
// Use it from your own migration tool if you do not want Migrate to run it.
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

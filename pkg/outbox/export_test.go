package outbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ClaimSQL lets the external tests EXPLAIN the claim.
const ClaimSQL = claimSQL

// ClaimHandedOverSQL is the hand-over relay's claim.
var ClaimHandedOverSQL = claimHandedOverSQL

// ClaimArgs are the arguments of ClaimSQL for a claim of up to limit rows,
// with the default MaxAttempts, that may take a suspect row alone.
func ClaimArgs(limit int, lease time.Duration) []any {
	return []any{limit, lease.Milliseconds(), DefaultMaxAttempts, int64(DefaultMaxInFlightBytes), true}
}

// ParseSchema lets the external tests check what Migrate accepts.
func ParseSchema(sql string) error {
	_, err := parseSchema(sql)
	return err
}

// SchemaVersion is the version Migrate brings a schema to.
var SchemaVersion = checkVersion(migrations())

// PlanError is the error of parsing the migrations, if any.
func PlanError() error {
	_, err := plan()
	return err
}

// withNext is the migrations with next appended as the next version.
func withNext(next string) []migration {
	migs := migrations()
	return append(migs[:len(migs):len(migs)], migration{version: len(migs) + 1, sql: next})
}

// MigrateNext is MigrateWithConfig for a next version of the package whose
// migration is the statements of next (not breaking).
func MigrateNext(ctx context.Context, pool *pgxpool.Pool, cfg MigrateConfig, next string) error {
	p, err := parseMigrations(withNext(next))
	if err != nil {
		return err
	}
	return migrateWith(ctx, pool, cfg, p)
}

// SchemaNext is Schema for that next version.
func SchemaNext(next string) string { return schemaOf(withNext(next)) }

// CheckSchemaNext is CheckSchema in a binary of that next version.
func CheckSchemaNext(ctx context.Context, db DB, next string) error {
	s, err := readSchemaState(ctx, db)
	if err != nil {
		return err
	}
	return s.check(checkVersion(withNext(next)))
}

// HeaderBytes lets the external tests check the measure of MaxHeaderBytes.
var HeaderBytes = headerBytes

// JSONBTextSize lets the external tests compare the measure of the text form
// with PostgreSQL's.
var JSONBTextSize = jsonbTextSize

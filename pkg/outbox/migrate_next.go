//go:build outbox_next_migration

package outbox

// nextMigrations is the next version of the schema that the chaos suite's
// migration_under_load fault (e2e) applies to the services' own database
// while they run: an orders binary built with the tag outbox_next_migration
// is the next release of this package, as a copier's upgrade would be. It
// adds a nullable column (a table lock, taken with a lock_timeout) and an
// index (built concurrently); binaries of version 1 keep running on it.
var nextMigrations = []migration{{version: 2, sql: `
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS next_note text;

CREATE INDEX IF NOT EXISTS outbox_next_created_at
    ON outbox (created_at);
`}}

//go:build !outbox_next_migration

package outbox

// nextMigrations is empty: see migrate_next.go.
var nextMigrations []migration

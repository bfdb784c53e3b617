package outbox

import "github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"

// Statement names one of the statements that do the relays' work per event,
// for a pgx tracer (pgx.QueryTracer, pgx.BatchTracer) that times or counts
// them: StatementOf tells which one a query is. The names stay; the
// statements' text changes between versions of this package, so match the
// name, never the text.
type Statement string

const (
	// StatementClaim is the polling relay's claim: one statement that
	// leases a batch of due events and returns them (also the claim of the
	// polling relay that package outboxwal runs for the rows it hands over).
	StatementClaim Statement = "claim"
	// StatementMark is the first statement of the polling relay's mark,
	// which moves the rows of confirmed events to outbox_published. It is
	// sent in a pgx.Batch: a tracer sees it in TraceBatchQuery.
	StatementMark Statement = "mark"
	// StatementSweep is the WAL relay's (package outboxwal) removal of the
	// rows of confirmed events: deleted, or moved to outbox_published
	// (outboxwal.Config.Archive).
	StatementSweep Statement = "sweep"
)

// statements are the texts StatementOf recognises.
var statements = map[string]Statement{
	claimSQL:             StatementClaim,
	claimHandedOverSQL:   StatementClaim,
	moveSQL:              StatementMark,
	outboxsql.SweepSQL:   StatementSweep,
	outboxsql.ArchiveSQL: StatementSweep,
}

// StatementOf returns the Statement that sql is, as a pgx tracer receives it
// (pgx.TraceQueryStartData.SQL, pgx.TraceBatchQueryData.SQL), or "" for any
// other SQL.
func StatementOf(sql string) Statement {
	return statements[sql]
}

package outbox

import "time"

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

// HeaderBytes lets the external tests check the measure of MaxHeaderBytes.
var HeaderBytes = headerBytes

// JSONBTextSize lets the external tests compare the measure of the text form
// with PostgreSQL's.
var JSONBTextSize = jsonbTextSize

// HistorySQL lets the external tests EXPLAIN Admin.History.
var HistorySQL = historySQL

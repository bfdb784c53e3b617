// Package outboxsql holds the statements on the outbox table that both
// relays run: the polling relay of package outbox and the WAL relay of
// package outboxwal. Package outbox owns the outbox tables (its schema.sql
// creates them and their indexes); this package is its seam for outboxwal,
// so that no statement is written twice: unblocking an aggregate's next
// event, walking the table, handing rows over to polling and finding them, sweeping confirmed
// rows, dead-lettering and recording attempts. (Their vacuum of the table is
// package vacuum's.) It also holds the statements of package outboxadmin
// (admin.go) and reads outbox_published for package outboxbackfill
// (archive.go), which replays it to a new consumer.
//
// Every function runs one statement on the DB it is given, usually a
// transaction of the caller's: the callers decide the isolation and the
// fencing.
package outboxsql

import (
	"context"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is what the statements need: pgx.Tx, *pgxpool.Pool and *pgx.Conn
// satisfy it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// MaxErrorText bounds what goes into last_error.
const MaxErrorText = 2000

// ErrorText makes s storable as last_error: valid UTF-8, no NUL, at most
// MaxErrorText bytes (cut at a character boundary, "..." appended).
func ErrorText(s string) string {
	s = strings.ToValidUTF8(s, "?")
	s = strings.ReplaceAll(s, "\x00", "?")
	if len(s) > MaxErrorText {
		cut := MaxErrorText
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "..."
	}
	return s
}

// UnblockNextSQL unblocks the next event of each aggregate whose head left
// the table ($1 aggregate types, $2 aggregate ids, $3 the versions that
// left). Run it in the transaction that moved or deleted those heads, as a
// later statement at READ COMMITTED: its snapshot, taken after the heads were
// locked, sees the row of every writer that looked at them before (see
// schema.sql on blocked rows).
const UnblockNextSQL = `
UPDATE outbox s
SET blocked = false
FROM unnest($1::text[], $2::text[], $3::bigint[]) AS m(aggregate_type, aggregate_id, version)
WHERE s.aggregate_type = m.aggregate_type
  AND s.aggregate_id = m.aggregate_id
  AND s.aggregate_version = m.version + 1
  AND s.blocked
  AND NOT EXISTS (
      SELECT 1 FROM outbox p
      WHERE p.aggregate_type = s.aggregate_type
        AND p.aggregate_id = s.aggregate_id
        AND p.aggregate_version < s.aggregate_version)`

// Head names an aggregate's event: its type, id and version.
type Head struct {
	AggregateType, AggregateID string
	Version                    int64
}

// UnblockNext runs UnblockNextSQL for heads.
func UnblockNext(ctx context.Context, db DB, heads []Head) error {
	types := make([]string, len(heads))
	aggIDs := make([]string, len(heads))
	versions := make([]int64, len(heads))
	for i, h := range heads {
		types[i], aggIDs[i], versions[i] = h.AggregateType, h.AggregateID, h.Version
	}
	if _, err := db.Exec(ctx, UnblockNextSQL, types, aggIDs, versions); err != nil {
		return fmt.Errorf("unblock the next events: %w", err)
	}
	return nil
}

// handOverRowsSQL hands over to polling those of the rows $2 not handed
// over yet, with $1 as the reason. A row blocked with no earlier event of its
// aggregate left (a row deleted by hand, or swept by a relay that did not
// unblock) is unblocked: the hand-over relay claims only unblocked rows. An
// earlier row cannot appear later (versions only grow), and one still in the
// table keeps the row blocked until polling moves it.
const handOverRowsSQL = `
UPDATE outbox o SET handed_over = true, last_error = coalesce(o.last_error, $1),
    blocked = o.blocked AND EXISTS (SELECT 1 FROM outbox p
                                    WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
                                      AND p.aggregate_version < o.aggregate_version)
WHERE o.id = ANY($2::bigint[]) AND NOT o.handed_over`

// HandOverRows runs handOverRowsSQL and returns how many rows it handed over.
func HandOverRows(ctx context.Context, db DB, ids []int64, reason string) (int64, error) {
	tag, err := db.Exec(ctx, handOverRowsSQL, ErrorText(reason), ids)
	if err != nil {
		return 0, fmt.Errorf("hand rows over to polling: %w", err)
	}
	return tag.RowsAffected(), nil
}

// RowRef is a row of the outbox as ListRows reads it.
type RowRef struct {
	ID         int64
	Aggregate  Aggregate
	HandedOver bool
}

// ListRows returns up to limit rows of the outbox with an id above after, in
// id order: one bounded step of a walk through the whole table.
func ListRows(ctx context.Context, db DB, after int64, limit int) ([]RowRef, error) {
	rows, err := db.Query(ctx, `SELECT id, aggregate_type, aggregate_id, handed_over FROM outbox
WHERE id > $1 ORDER BY id LIMIT $2`, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list the outbox's rows: %w", err)
	}
	var (
		out []RowRef
		r   RowRef
	)
	_, err = pgx.ForEachRow(rows, []any{&r.ID, &r.Aggregate.Type, &r.Aggregate.ID, &r.HandedOver}, func() error {
		out = append(out, r)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list the outbox's rows: %w", err)
	}
	return out, nil
}

// FirstUndelivered returns the smallest of ids still in the outbox and not
// dead-lettered, or 0 when there is none.
func FirstUndelivered(ctx context.Context, db DB, ids []int64) (int64, error) {
	var first *int64
	if err := db.QueryRow(ctx, `SELECT min(id) FROM outbox WHERE id = ANY($1::bigint[]) AND dead_lettered_at IS NULL`, ids).Scan(&first); err != nil {
		return 0, fmt.Errorf("look rows up: %w", err)
	}
	if first == nil {
		return 0, nil
	}
	return *first, nil
}

// Aggregate names an aggregate.
type Aggregate struct{ Type, ID string }

// HandedOverAggregates lists the aggregates with a row handed over.
func HandedOverAggregates(ctx context.Context, db DB) (map[Aggregate]bool, error) {
	rows, err := db.Query(ctx, `SELECT DISTINCT aggregate_type, aggregate_id FROM outbox WHERE handed_over`)
	if err != nil {
		return nil, fmt.Errorf("list the aggregates handed over: %w", err)
	}
	out := map[Aggregate]bool{}
	var a Aggregate
	_, err = pgx.ForEachRow(rows, []any{&a.Type, &a.ID}, func() error {
		out[a] = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list the aggregates handed over: %w", err)
	}
	return out, nil
}

// RowState is what Lookup finds of a row still in the outbox.
type RowState struct {
	// HandedOver says polling has the row.
	HandedOver bool
	// InFlight says an attempt was recorded and got no outcome.
	InFlight bool
}

// Lookup returns the state of those of ids still in the outbox.
func Lookup(ctx context.Context, db DB, ids []int64) (map[int64]RowState, error) {
	rows, err := db.Query(ctx, `SELECT id, handed_over, in_flight FROM outbox WHERE id = ANY($1::bigint[])`, ids)
	if err != nil {
		return nil, fmt.Errorf("look rows up: %w", err)
	}
	out := map[int64]RowState{}
	var (
		id int64
		st RowState
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &st.HandedOver, &st.InFlight}, func() error {
		out[id] = st
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("look rows up: %w", err)
	}
	return out, nil
}

// SweepSQL deletes the rows of confirmed events that it can lock at once,
// and returns their ids. A row it does not return is either gone already or
// locked: the writer of the aggregate's next event holds it FOR KEY SHARE
// until it commits (see schema.sql), and a relay never waits on a business
// transaction.
const SweepSQL = `
WITH locked AS (
    SELECT id FROM outbox WHERE id = ANY($1::bigint[])
    FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox o USING locked l WHERE o.id = l.id
RETURNING o.id`

// ArchiveSQL is SweepSQL moving the rows to outbox_published, their
// attempts counting the confirmed one.
const ArchiveSQL = `
WITH locked AS (
    SELECT id FROM outbox WHERE id = ANY($1::bigint[])
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM outbox o USING locked l WHERE o.id = l.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type,
              o.payload, o.headers, o.created_at, o.attempts
), archived AS (
    INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                                  payload, headers, created_at, attempts)
    SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at,
           attempts + 1
    FROM moved
    ON CONFLICT (id) DO NOTHING
)
SELECT id FROM moved`

// Sweep deletes (or, with archive, moves to outbox_published) those of ids
// whose rows it can lock at once, and returns them. Run UnblockNext for
// them after it, in the same transaction.
func Sweep(ctx context.Context, db DB, ids []int64, archive bool) ([]int64, error) {
	query := SweepSQL
	if archive {
		query = ArchiveSQL
	}
	rows, err := db.Query(ctx, query, ids)
	if err != nil {
		return nil, fmt.Errorf("sweep confirmed rows: %w", err)
	}
	swept, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("sweep confirmed rows: %w", err)
	}
	return swept, nil
}

// Present returns those of ids still in the outbox.
func Present(ctx context.Context, db DB, ids []int64) ([]int64, error) {
	rows, err := db.Query(ctx, `SELECT id FROM outbox WHERE id = ANY($1::bigint[])`, ids)
	if err != nil {
		return nil, fmt.Errorf("look rows up: %w", err)
	}
	left, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("look rows up: %w", err)
	}
	return left, nil
}

// Handing is a row to hand over to polling.
type Handing struct {
	ID int64
	// Reason goes into last_error.
	Reason string
	// Dead dead-letters the row, with Attempts as its attempts; otherwise
	// Added attempts are counted in the row (a failed attempt not recorded
	// yet), and polling claims it.
	Dead     bool
	Attempts int32
	Added    int32
}

// handOverSQL hands rows over to polling: a dead letter (with its attempts,
// unblocked when no earlier event of its aggregate is left, so that an
// operator's retry finds it), or a row polling retries or publishes in turn,
// behind an earlier handed-over row of its aggregate, blocked as Enqueue left
// it. Rows handed over already are left alone.
const handOverSQL = `
UPDATE outbox o
SET handed_over = true, last_error = f.err, in_flight = false,
    attempts = CASE WHEN f.dead THEN f.attempts ELSE o.attempts + f.added END,
    dead_lettered_at = CASE WHEN f.dead THEN now() END,
    next_attempt_at = CASE WHEN f.dead THEN now() ELSE o.next_attempt_at END,
    blocked = CASE WHEN f.dead THEN EXISTS (SELECT 1 FROM outbox p
                                            WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
                                              AND p.aggregate_version < o.aggregate_version)
                   ELSE o.blocked END
FROM unnest($1::bigint[], $2::text[], $3::bool[], $4::int[], $5::int[]) AS f(id, err, dead, attempts, added)
WHERE o.id = f.id AND NOT o.handed_over`

// HandOver runs handOverSQL for hs.
func HandOver(ctx context.Context, db DB, hs []Handing) error {
	n := len(hs)
	var (
		ids              = make([]int64, n)
		errs             = make([]string, n)
		dead             = make([]bool, n)
		attempts, addeds = make([]int32, n), make([]int32, n)
	)
	for i, h := range hs {
		ids[i], errs[i], dead[i], attempts[i], addeds[i] = h.ID, ErrorText(h.Reason), h.Dead, h.Attempts, h.Added
	}
	if _, err := db.Exec(ctx, handOverSQL, ids, errs, dead, attempts, addeds); err != nil {
		return fmt.Errorf("hand rows over to polling: %w", err)
	}
	return nil
}

// recordAttemptsSQL records that an attempt of each row begins: attempts + 1,
// in_flight. It returns the new attempts and whether the row was in flight
// already (an attempt recorded before had no outcome: its relay stopped).
// Rows handed over are not touched.
const recordAttemptsSQL = `
WITH prev AS (
    SELECT id, in_flight FROM outbox
    WHERE id = ANY($1::bigint[]) AND NOT handed_over
    FOR NO KEY UPDATE
)
UPDATE outbox o SET attempts = o.attempts + 1, in_flight = true
FROM prev WHERE o.id = prev.id
RETURNING o.id, o.attempts, prev.in_flight`

// Attempt is what RecordAttempts found for a row.
type Attempt struct {
	// Attempts counts the recorded attempts, this one included.
	Attempts int
	// WasInFlight says an earlier recorded attempt got no outcome.
	WasInFlight bool
}

// RecordAttempts runs recordAttemptsSQL.
func RecordAttempts(ctx context.Context, db DB, ids []int64) (map[int64]Attempt, error) {
	rows, err := db.Query(ctx, recordAttemptsSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("record attempts: %w", err)
	}
	out := make(map[int64]Attempt, len(ids))
	var (
		id int64
		a  Attempt
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &a.Attempts, &a.WasInFlight}, func() error {
		out[id] = a
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("record attempts: %w", err)
	}
	return out, nil
}

// UnrecordAttempts takes back recorded attempts that the broker confirmed:
// the row's attempts count only the recorded attempts that got no confirm.
func UnrecordAttempts(ctx context.Context, db DB, ids []int64) error {
	_, err := db.Exec(ctx, `
UPDATE outbox SET attempts = greatest(attempts - 1, 0), in_flight = false
WHERE id = ANY($1::bigint[]) AND in_flight AND NOT handed_over`, ids)
	if err != nil {
		return fmt.Errorf("take back confirmed attempts: %w", err)
	}
	return nil
}

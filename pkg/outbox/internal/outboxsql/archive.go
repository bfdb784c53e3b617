package outboxsql

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Archived is an event of outbox_published as ReadArchive returns it.
type Archived struct {
	ID               int64
	AggregateType    string
	AggregateID      string
	AggregateVersion int64
	EventType        string
	Payload          []byte
	Headers          []byte // the jsonb object's text
	CreatedAt        time.Time
	Attempts         int
	PublishedAt      time.Time
}

// Key orders the archive: an aggregate's events follow each other in
// version order, aggregates in (type, id) order. The zero Key comes before
// every event.
type Key struct {
	AggregateType, AggregateID string
	Version                    int64
}

// Selection is the part of the archive a replay reads: events created in
// [From, Until] and archived (published_at) up to ArchivedBy, of Aggregates
// when that is not empty (types and ids, pairwise). A zero bound is no bound.
type Selection struct {
	From, Until time.Time
	ArchivedBy  time.Time
	Types, IDs  []string
}

// archiveFilter selects the events of a Selection after a Key: $1..$3 the
// key, $4 From, $5 Until, $6 ArchivedBy.
const archiveFilter = `(p.aggregate_type, p.aggregate_id, p.aggregate_version) > ($1, $2, $3)
  AND p.created_at >= $4 AND p.created_at <= $5 AND p.published_at <= $6`

const archiveColumns = `p.id, p.aggregate_type, p.aggregate_id, p.aggregate_version, p.event_type,
       p.payload, p.headers, p.created_at, p.attempts, p.published_at`

// readArchiveSQL reads the next $7 events of the whole archive through
// outbox_published_aggregate_version, in its order.
const readArchiveSQL = `
SELECT ` + archiveColumns + `
FROM outbox_published p
WHERE ` + archiveFilter + `
ORDER BY p.aggregate_type, p.aggregate_id, p.aggregate_version
LIMIT $7`

// readAggregatesSQL reads the next $7 events of the aggregates $8 (types),
// $9 (ids): the same index, one range per aggregate.
const readAggregatesSQL = `
SELECT a.* FROM unnest($8::text[], $9::text[]) AS g(aggregate_type, aggregate_id)
CROSS JOIN LATERAL (
    SELECT ` + archiveColumns + `
    FROM outbox_published p
    WHERE p.aggregate_type = g.aggregate_type AND p.aggregate_id = g.aggregate_id
      AND ` + archiveFilter + `
    ORDER BY p.aggregate_version
    LIMIT $7) a
ORDER BY 2, 3, 4
LIMIT $7`

// countArchiveSQL and countAggregatesSQL count what the reads return from
// the zero key.
const (
	countArchiveSQL = `
SELECT count(*) FROM outbox_published p WHERE ` + archiveFilter
	countAggregatesSQL = `
SELECT count(*) FROM unnest($7::text[], $8::text[]) AS g(aggregate_type, aggregate_id)
JOIN outbox_published p ON p.aggregate_type = g.aggregate_type AND p.aggregate_id = g.aggregate_id
WHERE ` + archiveFilter
)

// bounds gives From, Until and ArchivedBy their meaning when zero: no bound.
func bounds(s Selection) (from, until, archivedBy time.Time) {
	orElse := func(t, dflt time.Time) time.Time {
		if t.IsZero() {
			return dflt
		}
		return t
	}
	first, last := time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)
	return orElse(s.From, first), orElse(s.Until, last), orElse(s.ArchivedBy, last)
}

// ReadArchive returns up to limit events of s that come after key, in Key
// order: each aggregate's events in version order.
func ReadArchive(ctx context.Context, db DB, s Selection, after Key, limit int) ([]Archived, error) {
	from, until, archivedBy := bounds(s)
	args := []any{after.AggregateType, after.AggregateID, after.Version, from, until, archivedBy, limit}
	query := readArchiveSQL
	if len(s.Types) > 0 {
		query = readAggregatesSQL
		args = append(args, s.Types, s.IDs)
	}
	rows, err := db.Query(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("read the archive: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Archived, error) {
		var a Archived
		err := r.Scan(&a.ID, &a.AggregateType, &a.AggregateID, &a.AggregateVersion, &a.EventType,
			&a.Payload, &a.Headers, &a.CreatedAt, &a.Attempts, &a.PublishedAt)
		return a, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the archive: %w", err)
	}
	return out, nil
}

// CountArchive counts the events of s.
func CountArchive(ctx context.Context, db DB, s Selection) (int64, error) {
	from, until, archivedBy := bounds(s)
	args := []any{"", "", int64(0), from, until, archivedBy}
	query := countArchiveSQL
	if len(s.Types) > 0 {
		query = countAggregatesSQL
		args = append(args, s.Types, s.IDs)
	}
	var n int64
	if err := db.QueryRow(ctx, query, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("count the archive: %w", err)
	}
	return n, nil
}

// Outstanding is what CountOutstanding finds.
type Outstanding struct {
	// Count is how many rows it found, OldestID the smallest id among them
	// (0 when none).
	Count, OldestID int64
	// At is the database's clock after the statement's snapshot was taken:
	// every row archived before that snapshot has a published_at before At.
	At time.Time
}

// outstandingSQL counts the rows of outbox created in [$1, $2], of the
// aggregates $3 (types), $4 (ids) when not empty, that a relay may still
// move to outbox_published without publishing them again: all but the dead
// letters and the rows behind one (an earlier version of their aggregate
// dead-lettered), which wait for an operator's Retry or Discard.
const outstandingSQL = `
SELECT count(*), coalesce(min(o.id), 0), clock_timestamp()
FROM outbox o
WHERE o.created_at >= $1 AND o.created_at <= $2
  AND (coalesce(cardinality($3::text[]), 0) = 0
       OR (o.aggregate_type, o.aggregate_id) IN (SELECT * FROM unnest($3::text[], $4::text[])))
  AND NOT EXISTS (SELECT 1 FROM outbox d
                  WHERE d.aggregate_type = o.aggregate_type AND d.aggregate_id = o.aggregate_id
                    AND d.aggregate_version <= o.aggregate_version AND d.dead_lettered_at IS NOT NULL)`

// CountOutstanding runs outstandingSQL for the creation bounds and the
// aggregates of s.
func CountOutstanding(ctx context.Context, db DB, s Selection) (Outstanding, error) {
	from, until, _ := bounds(s)
	var o Outstanding
	if err := db.QueryRow(ctx, outstandingSQL, from, until, s.Types, s.IDs).Scan(&o.Count, &o.OldestID, &o.At); err != nil {
		return Outstanding{}, fmt.Errorf("count the outbox's rows not archived yet: %w", err)
	}
	return o, nil
}

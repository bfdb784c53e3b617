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

// Selection is the part of the archive a replay reads: events published
// in [From, Until], of Aggregates when that is not empty (types and ids,
// pairwise).
type Selection struct {
	From, Until time.Time
	Types, IDs  []string
}

// archiveFilter selects the events of a Selection after a Key: $1..$3 the
// key, $4 From, $5 Until.
const archiveFilter = `(p.aggregate_type, p.aggregate_id, p.aggregate_version) > ($1, $2, $3)
  AND p.published_at >= $4 AND p.published_at <= $5`

const archiveColumns = `p.id, p.aggregate_type, p.aggregate_id, p.aggregate_version, p.event_type,
       p.payload, p.headers, p.created_at, p.attempts, p.published_at`

// readArchiveSQL reads the next $6 events of the whole archive through
// outbox_published_aggregate_version, in its order.
const readArchiveSQL = `
SELECT ` + archiveColumns + `
FROM outbox_published p
WHERE ` + archiveFilter + `
ORDER BY p.aggregate_type, p.aggregate_id, p.aggregate_version
LIMIT $6`

// readAggregatesSQL reads the next $6 events of the aggregates $7 (types),
// $8 (ids): the same index, one range per aggregate.
const readAggregatesSQL = `
SELECT a.* FROM unnest($7::text[], $8::text[]) AS g(aggregate_type, aggregate_id)
CROSS JOIN LATERAL (
    SELECT ` + archiveColumns + `
    FROM outbox_published p
    WHERE p.aggregate_type = g.aggregate_type AND p.aggregate_id = g.aggregate_id
      AND ` + archiveFilter + `
    ORDER BY p.aggregate_version
    LIMIT $6) a
ORDER BY 2, 3, 4
LIMIT $6`

// countArchiveSQL and countAggregatesSQL count what the reads return from
// the zero key.
const (
	countArchiveSQL = `
SELECT count(*) FROM outbox_published p WHERE ` + archiveFilter
	countAggregatesSQL = `
SELECT count(*) FROM unnest($6::text[], $7::text[]) AS g(aggregate_type, aggregate_id)
JOIN outbox_published p ON p.aggregate_type = g.aggregate_type AND p.aggregate_id = g.aggregate_id
WHERE ` + archiveFilter
)

// bounds gives From and Until their meaning when zero: no bound.
func bounds(s Selection) (time.Time, time.Time) {
	until := s.Until
	if until.IsZero() {
		until = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	from := s.From
	if from.IsZero() {
		from = time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	return from, until
}

// ReadArchive returns up to limit events of s that come after key, in Key
// order: each aggregate's events in version order.
func ReadArchive(ctx context.Context, db DB, s Selection, after Key, limit int) ([]Archived, error) {
	from, until := bounds(s)
	args := []any{after.AggregateType, after.AggregateID, after.Version, from, until, limit}
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
	from, until := bounds(s)
	args := []any{"", "", int64(0), from, until}
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

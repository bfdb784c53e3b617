package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrNotFound is returned by Admin.Retry when no dead-lettered event has the id.
var ErrNotFound = errors.New("outbox: not found")

// DB is what Admin needs to run its statements: *pgxpool.Pool, *pgx.Conn and
// pgx.Tx all satisfy it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Admin holds the operator's actions on an outbox: inspect and retry dead
// letters, read the backlog's status, purge old published rows. It works on the
// database alone, so a CLI can use it without a running relay.
type Admin struct {
	db DB
}

// NewAdmin returns an Admin working on db, in the schema of db's search_path.
func NewAdmin(db DB) *Admin {
	return &Admin{db: db}
}

// DeadLetter is an event that reached its relay's MaxAttempts. It stays in the
// outbox, and holds back the later events of its aggregate, until retried.
type DeadLetter struct {
	ID               int64             `json:"id"`
	AggregateType    string            `json:"aggregate_type"`
	AggregateID      string            `json:"aggregate_id"`
	AggregateVersion int64             `json:"aggregate_version"`
	EventType        string            `json:"event_type"`
	Payload          json.RawMessage   `json:"payload"`
	Headers          map[string]string `json:"headers"`
	Attempts         int               `json:"attempts"`
	LastError        string            `json:"last_error"`
	CreatedAt        time.Time         `json:"created_at"`
	DeadLetteredAt   time.Time         `json:"dead_lettered_at"`
}

// MaxDeadLettersPage bounds the limit of Admin.DeadLetters.
const MaxDeadLettersPage = 1000

// DeadLetters lists up to limit dead letters with an id greater than afterID, by
// id: pass 0, then the last id of the previous page. limit must be in
// 1..MaxDeadLettersPage.
func (a *Admin) DeadLetters(ctx context.Context, afterID int64, limit int) ([]DeadLetter, error) {
	if limit < 1 || limit > MaxDeadLettersPage {
		return nil, fmt.Errorf("outbox dead letters: limit %d: must be in 1..%d", limit, MaxDeadLettersPage)
	}
	if afterID < 0 {
		return nil, fmt.Errorf("outbox dead letters: afterID %d: must not be negative", afterID)
	}
	rows, err := a.db.Query(ctx, `
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers,
       attempts, coalesce(last_error, ''), created_at, dead_lettered_at
FROM outbox
WHERE dead_lettered_at IS NOT NULL AND id > $1
ORDER BY id
LIMIT $2`, afterID, limit)
	if err != nil {
		return nil, fmt.Errorf("outbox dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) {
		var d DeadLetter
		err := r.Scan(&d.ID, &d.AggregateType, &d.AggregateID, &d.AggregateVersion, &d.EventType,
			&d.Payload, &d.Headers, &d.Attempts, &d.LastError, &d.CreatedAt, &d.DeadLetteredAt)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox dead letters: %w", err)
	}
	return out, nil
}

// retrySQL gives dead letters a fresh set of attempts, due now. last_error is
// kept: it is the history the operator acted on.
const retrySQL = `
UPDATE outbox
SET attempts = 0, next_attempt_at = now(), dead_lettered_at = NULL
WHERE dead_lettered_at IS NOT NULL`

// Retry puts the dead letter id back in the queue with its attempts reset. It
// returns ErrNotFound when no dead letter has that id (never existed, already
// retried, or published).
func (a *Admin) Retry(ctx context.Context, id int64) error {
	if id <= 0 {
		return fmt.Errorf("outbox retry: id %d: must be positive", id)
	}
	tag, err := a.db.Exec(ctx, retrySQL+" AND id = $1", id)
	if err != nil {
		return fmt.Errorf("outbox retry %d: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("outbox retry %d: no dead letter with this id: %w", id, ErrNotFound)
	}
	return nil
}

// RetryAll puts every dead letter back in the queue, like Retry, and returns how
// many there were.
func (a *Admin) RetryAll(ctx context.Context) (int64, error) {
	tag, err := a.db.Exec(ctx, retrySQL)
	if err != nil {
		return 0, fmt.Errorf("outbox retry all: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Status describes the backlog.
type Status struct {
	// Pending counts rows not published yet and not dead-lettered: due, in
	// flight, backing off, or waiting behind an earlier event of their aggregate.
	Pending int64
	// DeadLettered counts dead letters. Alert on it.
	DeadLettered int64
	// OldestPendingAge is how long the oldest pending row has waited, 0 when
	// nothing is pending. Alert when it exceeds what a healthy relay needs.
	OldestPendingAge time.Duration
}

// Status reads the backlog. It scans the outbox table, which holds the backlog
// only, never the history.
func (a *Admin) Status(ctx context.Context) (Status, error) {
	var s Status
	var ageMicros int64
	err := a.db.QueryRow(ctx, `
SELECT count(*) FILTER (WHERE dead_lettered_at IS NULL),
       count(*) FILTER (WHERE dead_lettered_at IS NOT NULL),
       coalesce((extract(epoch FROM now() - min(created_at) FILTER (WHERE dead_lettered_at IS NULL)) * 1e6)::bigint, 0)
FROM outbox`).Scan(&s.Pending, &s.DeadLettered, &ageMicros)
	if err != nil {
		return Status{}, fmt.Errorf("outbox status: %w", err)
	}
	s.OldestPendingAge = max(0, time.Duration(ageMicros)*time.Microsecond)
	return s, nil
}

// MaxPurgeBatch bounds the batch size of Admin.Purge.
const MaxPurgeBatch = 100_000

// purgeSQL deletes one batch of old published rows. SKIP LOCKED lets several
// relays purge at once without waiting on each other.
const purgeSQL = `
DELETE FROM outbox_published
WHERE id IN (
    SELECT id FROM outbox_published
    WHERE published_at < now() - $1::bigint * interval '1 microsecond'
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)`

// Purge deletes published rows older than olderThan, batchSize rows per
// statement (each its own short transaction), until none is left, and returns
// how many it deleted. Small batches keep locks and WAL bursts small on a busy
// database; ctx stops it between (or during) batches.
func (a *Admin) Purge(ctx context.Context, olderThan time.Duration, batchSize int) (int64, error) {
	if olderThan <= 0 {
		return 0, fmt.Errorf("outbox purge: olderThan %v: must be positive", olderThan)
	}
	if batchSize < 1 || batchSize > MaxPurgeBatch {
		return 0, fmt.Errorf("outbox purge: batchSize %d: must be in 1..%d", batchSize, MaxPurgeBatch)
	}
	var total int64
	for {
		tag, err := a.db.Exec(ctx, purgeSQL, olderThan.Microseconds(), batchSize)
		if err != nil {
			return total, fmt.Errorf("outbox purge: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, nil
		}
	}
}

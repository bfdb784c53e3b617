// Package outboxadmin holds the operator's actions on an outbox of package
// outbox (see [Admin]): dead letters hold back their aggregate until an
// operator retries or discards them here. The relays do not need it.
package outboxadmin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
)

// ErrNotFound is returned by Admin.Retry when no dead-lettered event has the
// id, and by Admin.Discard when no event has it.
var ErrNotFound = errors.New("outbox: not found")

// ErrNotDeadLettered is returned by Admin.Discard for an event that is in the
// outbox but not dead-lettered: pending, in flight or blocked. Only a dead
// letter can be discarded.
var ErrNotDeadLettered = errors.New("outbox: not a dead letter")

// Admin holds the operator's actions on an outbox: inspect, retry and discard
// dead letters, read the backlog's status, purge old published rows. It works on the
// database alone, so a CLI can use it without a running relay.
type Admin struct {
	db outbox.DB
}

// New returns an Admin working on db, in the schema of db's search_path.
func New(db outbox.DB) *Admin {
	return &Admin{db: db}
}

// DeadLetter is an event that reached its relay's MaxAttempts
// ([outbox.RelayConfig.MaxAttempts]). It stays in the outbox, and holds back
// the later events of its aggregate, until retried or discarded.
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
	rows, err := a.db.Query(ctx, outboxsql.DeadLettersSQL, afterID, limit)
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

// Retry puts the dead letter id back in the queue with its attempts reset. It
// returns ErrNotFound when no dead letter has that id (never existed, already
// retried, or published).
func (a *Admin) Retry(ctx context.Context, id int64) error {
	if id <= 0 {
		return fmt.Errorf("outbox retry: id %d: must be positive", id)
	}
	tag, err := a.db.Exec(ctx, outboxsql.RetrySQL+" AND id = $1", id)
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
	tag, err := a.db.Exec(ctx, outboxsql.RetrySQL)
	if err != nil {
		return 0, fmt.Errorf("outbox retry all: %w", err)
	}
	return tag.RowsAffected(), nil
}

// MaxDiscardReasonBytes bounds the reason of Admin.Discard.
const MaxDiscardReasonBytes = 1000

// Discard gives up on the dead letter id, for an event that can never be
// published (a payload every consumer rejects, a message the broker refuses):
// it moves the event to the outbox_discarded table with reason and the time,
// and lets the later events of its aggregate go out, in order, as if it had
// been published. Consumers never receive it; tell them by other means if they
// need to know.
//
// Only a dead letter can be discarded: Discard returns an error wrapping
// ErrNotFound when no event has the id (never existed, published, or already
// discarded) and ErrNotDeadLettered when the event is pending, in flight or
// blocked; nothing changes then. reason is required, at most
// MaxDiscardReasonBytes of UTF-8. Discard waits for a writer that is
// enqueueing the aggregate's next event, until that writer's transaction ends.
// Its transaction runs at READ COMMITTED whatever the default isolation level;
// an Admin made on a pgx.Tx at another level gets an error instead.
func (a *Admin) Discard(ctx context.Context, id int64, reason string) error {
	switch {
	case id <= 0:
		return fmt.Errorf("outbox discard: id %d: must be positive", id)
	case reason == "":
		return fmt.Errorf("outbox discard %d: a reason is required", id)
	case len(reason) > MaxDiscardReasonBytes:
		return fmt.Errorf("outbox discard %d: reason has %d bytes, more than %d", id, len(reason), MaxDiscardReasonBytes)
	}
	if err := outboxsql.StorableText(reason); err != nil {
		return fmt.Errorf("outbox discard %d: reason: %w", id, err)
	}
	err := pgx.BeginFunc(ctx, a.db, func(tx pgx.Tx) error {
		// discardSQL needs a snapshot of its own, taken after the lock was
		// granted: at REPEATABLE READ (a server or role default) it would reuse
		// the one taken before the wait and miss the waited-for writer's row,
		// leaving it blocked behind nothing. Inside a caller's transaction
		// already at another level, this fails rather than strand that row.
		if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"); err != nil {
			return fmt.Errorf("set read committed: %w", err)
		}
		var dead bool
		err := tx.QueryRow(ctx, outboxsql.DiscardLockSQL, id).Scan(&dead)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("no event with this id: %w", ErrNotFound)
		}
		if err != nil {
			return fmt.Errorf("lock event: %w", err)
		}
		if !dead {
			return fmt.Errorf("the event is pending, not dead-lettered: %w", ErrNotDeadLettered)
		}
		tag, err := tx.Exec(ctx, outboxsql.DiscardSQL, id, reason)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 { // retried or discarded meanwhile
			return fmt.Errorf("the event is no longer a dead letter: %w", ErrNotDeadLettered)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("outbox discard %d: %w", id, err)
	}
	return nil
}

// StatusCountLimit bounds how many rows Admin.Status counts, so that its cost
// stays the same however large the backlog grows (Status runs on every metrics
// scrape of every process, and a backlog grows during a broker outage).
const StatusCountLimit = 1000

// StatusCountLimit is the limit outboxsql.StatusSQL counts to: this fails to
// compile if the two differ.
const _ = uint(StatusCountLimit-outboxsql.StatusCountLimit) + uint(outboxsql.StatusCountLimit-StatusCountLimit)

// Status describes the backlog.
type Status struct {
	// Pending counts rows not published yet and not dead-lettered: due, in
	// flight, backing off, or waiting behind an earlier event of their
	// aggregate. It is exact up to StatusCountLimit. Above it, PendingEstimated
	// is set and Pending is PostgreSQL's running estimate of the outbox table's
	// live rows (pg_stat_user_tables.n_live_tup, kept up to date by every insert
	// and delete, reported within a second or so) less the dead letters, and
	// never less than StatusCountLimit + 1.
	Pending int64
	// PendingEstimated says that Pending is an estimate (see Pending).
	PendingEstimated bool
	// DeadLettered counts dead letters. Alert on it. It is exact up to
	// StatusCountLimit; more are reported as StatusCountLimit + 1.
	DeadLettered int64
	// OldestPendingAge is how long the oldest pending row has waited, 0 when
	// nothing is pending. Alert on it. When Pending is estimated, it is the age
	// of the pending row with the smallest id (0 when more than
	// StatusCountLimit dead letters come before every pending row).
	OldestPendingAge time.Duration
}

// Status reads the backlog, at a cost bounded by StatusCountLimit rows however
// large the backlog is: see Status for what is exact and what is estimated.
func (a *Admin) Status(ctx context.Context) (Status, error) {
	var (
		s                   Status
		live, counted, dead int64
		ageMicros           int64
	)
	err := a.db.QueryRow(ctx, outboxsql.StatusSQL).Scan(&live, &counted, &dead, &ageMicros)
	if err != nil {
		return Status{}, fmt.Errorf("outbox status: %w", err)
	}
	s.DeadLettered = dead
	if live <= StatusCountLimit && counted <= StatusCountLimit {
		s.Pending = counted
	} else {
		s.Pending = max(live-dead, StatusCountLimit+1)
		s.PendingEstimated = true
	}
	s.OldestPendingAge = max(0, time.Duration(ageMicros)*time.Microsecond)
	return s, nil
}

// Purge deletes published rows older than olderThan, batchSize rows per
// statement (1 to 100,000; each its own short transaction), until none is left, and returns
// how many it deleted. Small batches keep locks and WAL bursts small on a busy
// database; ctx stops it between (or during) batches.
func (a *Admin) Purge(ctx context.Context, olderThan time.Duration, batchSize int) (int64, error) {
	return outboxsql.Purge(ctx, a.db, olderThan, batchSize)
}

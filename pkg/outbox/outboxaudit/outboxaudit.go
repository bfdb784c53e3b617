// Package outboxaudit reads what an outbox of package outbox committed, for
// a loss audit that compares it with what a consumer applied (see
// [EventLog]). The outbox does not need it: a copy of package outbox may
// delete this directory.
package outboxaudit

import (
	"context"
	"fmt"
	"iter"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// EventLog reads what this outbox committed, for a loss audit that compares
// it with what a consumer applied: every event of a window, with where it is
// in its life. An event lives in one of three tables at a time (outbox while
// pending or dead-lettered, outbox_published once the broker confirmed it,
// outbox_discarded once an operator discarded it), and moves between them in
// one transaction, so each statement of EventLog, which reads the three
// under one snapshot, sees it exactly once.
//
// Events reads in pages of PageSize rows, keyset by id on the tables'
// primary keys: each page is one short statement, no transaction stays open
// across a scan, and memory holds one page, however large the window. An
// event that commits after the scan went past its id (ids are taken at
// insert, commits come in another order) is not in that scan; the next one
// sees it. A scan needs the published rows kept: a relay that deletes them
// instead (outboxwal without Archive) leaves nothing to audit.
type EventLog struct {
	db       outbox.DB
	pageSize int
}

// DefaultEventLogPage is the page size of an EventLog made with pageSize 0,
// and MaxEventLogPage the largest one NewEventLog accepts.
const (
	DefaultEventLogPage = 10_000
	MaxEventLogPage     = 100_000
)

// MaxEventLookup bounds the ids of one EventLog.Lookup.
const MaxEventLookup = 10_000

// LoggedEvent is an event as EventLog reads it.
type LoggedEvent struct {
	ID               int64
	AggregateType    string
	AggregateID      string
	AggregateVersion int64
	CreatedAt        time.Time
	State            outbox.EventState
	// Since is when the event reached State: published_at,
	// dead_lettered_at or discarded_at; zero for EventPending.
	Since time.Time
}

// MessageID is the message id e was published under ([outbox.MessageID]).
func (e LoggedEvent) MessageID() string { return outbox.MessageID(e.ID, e.CreatedAt) }

// EventWindow selects the events of a scan. Zero fields do not bound it.
type EventWindow struct {
	// Since and Until bound created_at: Since <= created_at < Until.
	Since, Until time.Time
	// MinID and MaxID bound the id, both included.
	MinID, MaxID int64
	// Narrow leaves the events' AggregateType, AggregateID and
	// AggregateVersion empty: the scan reads only what an audit compares
	// (id, creation time, state), which PostgreSQL serves about twice as
	// fast. Lookup reads the whole event of an id.
	Narrow bool
}

// NewEventLog returns an EventLog on db (the schema of its search_path)
// reading pageSize rows per statement: 0 for DefaultEventLogPage, at most
// MaxEventLogPage.
func NewEventLog(db outbox.DB, pageSize int) (*EventLog, error) {
	if db == nil {
		return nil, fmt.Errorf("outbox event log: nil db")
	}
	if pageSize < 0 || pageSize > MaxEventLogPage {
		return nil, fmt.Errorf("outbox event log: page size %d: want 0 (default %d) to %d", pageSize, DefaultEventLogPage, MaxEventLogPage)
	}
	if pageSize == 0 {
		pageSize = DefaultEventLogPage
	}
	return &EventLog{db: db, pageSize: pageSize}, nil
}

// eventsSQL is one page of Events: the next $5 events by id after $1, up to
// $2, created in [$3, $4), from the three tables. Each branch walks its
// table's primary key in order and stops at the limit. narrowEventsSQL is
// the same page without the aggregate's columns (EventWindow.Narrow).
var (
	eventsSQL       = eventsPageSQL("aggregate_type, aggregate_id, aggregate_version")
	narrowEventsSQL = eventsPageSQL("'', '', 0::bigint")
)

// eventsPageSQL is the statement of a page of Events that reads agg (three
// columns: the aggregate's type, id and version) from each table.
func eventsPageSQL(agg string) string {
	return `
SELECT id, aggregate_type, aggregate_id, aggregate_version, created_at, state, since FROM (
    (SELECT id, ` + agg + `, created_at,
            CASE WHEN dead_lettered_at IS NULL THEN 'pending' ELSE 'dead_lettered' END AS state,
            dead_lettered_at AS since
     FROM outbox
     WHERE id > $1 AND id <= $2 AND created_at >= $3 AND created_at < $4
     ORDER BY id LIMIT $5)
    UNION ALL
    (SELECT id, ` + agg + `, created_at, 'published', published_at
     FROM outbox_published
     WHERE id > $1 AND id <= $2 AND created_at >= $3 AND created_at < $4
     ORDER BY id LIMIT $5)
    UNION ALL
    (SELECT id, ` + agg + `, created_at, 'discarded', discarded_at
     FROM outbox_discarded
     WHERE id > $1 AND id <= $2 AND created_at >= $3 AND created_at < $4
     ORDER BY id LIMIT $5)
) e (id, aggregate_type, aggregate_id, aggregate_version, created_at, state, since)
ORDER BY id
LIMIT $5`
}

// lookupSQL finds the events of the ids $1, whatever their creation time.
const lookupSQL = `
SELECT id, aggregate_type, aggregate_id, aggregate_version, created_at,
       CASE WHEN dead_lettered_at IS NULL THEN 'pending' ELSE 'dead_lettered' END, dead_lettered_at
FROM outbox WHERE id = ANY($1)
UNION ALL
SELECT id, aggregate_type, aggregate_id, aggregate_version, created_at, 'published', published_at
FROM outbox_published WHERE id = ANY($1)
UNION ALL
SELECT id, aggregate_type, aggregate_id, aggregate_version, created_at, 'discarded', discarded_at
FROM outbox_discarded WHERE id = ANY($1)
ORDER BY id`

// Events yields the events of w in id order, one page per statement (see
// EventLog). It stops at the first error, which it yields, wrapped; a
// consumer that stops ranging early ends the scan.
func (l *EventLog) Events(ctx context.Context, w EventWindow) iter.Seq2[LoggedEvent, error] {
	return func(yield func(LoggedEvent, error) bool) {
		after, last := max(w.MinID, 1)-1, w.MaxID
		if last == 0 {
			last = math.MaxInt64
		}
		since, until := bound(w.Since, pgtype.NegativeInfinity), bound(w.Until, pgtype.Infinity)
		query := eventsSQL
		if w.Narrow {
			query = narrowEventsSQL
		}
		page := make([]LoggedEvent, 0, l.pageSize)
		for after < last {
			var err error
			page, err = l.page(ctx, page[:0], query, after, last, since, until)
			if err != nil {
				yield(LoggedEvent{}, fmt.Errorf("outbox event log: read events after id %d: %w", after, err))
				return
			}
			for _, e := range page {
				if !yield(e, nil) {
					return
				}
			}
			if len(page) < l.pageSize {
				return
			}
			after = page[len(page)-1].ID
		}
	}
}

// bound is t for a query, or the infinity given when t is zero.
func bound(t time.Time, inf pgtype.InfinityModifier) pgtype.Timestamptz {
	if t.IsZero() {
		return pgtype.Timestamptz{InfinityModifier: inf, Valid: true}
	}
	return pgtype.Timestamptz{Time: t, Valid: true}
}

func (l *EventLog) page(ctx context.Context, page []LoggedEvent, query string, after, last int64, since, until pgtype.Timestamptz) ([]LoggedEvent, error) {
	rows, err := l.db.Query(ctx, query, after, last, since, until, l.pageSize)
	if err != nil {
		return page, err
	}
	return appendEvents(rows, page)
}

// appendEvents scans rows of (id, aggregate_type, aggregate_id,
// aggregate_version, created_at, state, since) onto page.
func appendEvents(rows pgx.Rows, page []LoggedEvent) ([]LoggedEvent, error) {
	defer rows.Close()
	var (
		e     LoggedEvent
		state string
		at    pgtype.Timestamptz
	)
	for rows.Next() {
		if err := rows.Scan(&e.ID, &e.AggregateType, &e.AggregateID, &e.AggregateVersion, &e.CreatedAt, &state, &at); err != nil {
			return page, err
		}
		e.State, e.Since = outbox.EventState(state), at.Time
		page = append(page, e)
	}
	return page, rows.Err()
}

// Lookup returns the events among ids that the outbox holds, in any state
// and whatever their creation time, in id order; an id it does not hold
// (never committed, or published and purged since) is not in the result.
// It takes at most MaxEventLookup ids.
func (l *EventLog) Lookup(ctx context.Context, ids []int64) ([]LoggedEvent, error) {
	if len(ids) > MaxEventLookup {
		return nil, fmt.Errorf("outbox event log: lookup of %d ids: at most %d", len(ids), MaxEventLookup)
	}
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := l.db.Query(ctx, lookupSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("outbox event log: look up %d ids: %w", len(ids), err)
	}
	out, err := appendEvents(rows, nil)
	if err != nil {
		return nil, fmt.Errorf("outbox event log: look up %d ids: %w", len(ids), err)
	}
	return out, nil
}

// EventCounts counts the events an outbox holds, by state.
type EventCounts struct {
	// Pending, DeadLettered, Published and Discarded count the events in
	// each state ([outbox.EventState]); Published counts those retention has not
	// purged yet.
	Pending, DeadLettered, Published, Discarded int64
	// OldestPendingAge is how long the oldest pending event has waited; 0
	// when none is pending.
	OldestPendingAge time.Duration
}

// countsSQL counts every table in full.
const countsSQL = `
SELECT (SELECT count(*) FROM outbox WHERE dead_lettered_at IS NULL),
       (SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL),
       (SELECT count(*) FROM outbox_published),
       (SELECT count(*) FROM outbox_discarded),
       coalesce((SELECT (extract(epoch FROM now() - min(created_at)) * 1e6)::bigint
                 FROM outbox WHERE dead_lettered_at IS NULL), 0)`

// Counts counts the events of every state exactly, in one statement (one
// snapshot, so an event moving between tables meanwhile counts once). It
// reads every table in full: for an audit, a test or a demo, not for every
// metrics scrape (outboxadmin's Admin.Status costs the same however large the backlog is).
func (l *EventLog) Counts(ctx context.Context) (EventCounts, error) {
	var c EventCounts
	var ageMicros int64
	if err := l.db.QueryRow(ctx, countsSQL).Scan(&c.Pending, &c.DeadLettered, &c.Published, &c.Discarded, &ageMicros); err != nil {
		return EventCounts{}, fmt.Errorf("outbox event log: count the events: %w", err)
	}
	c.OldestPendingAge = max(0, time.Duration(ageMicros)*time.Microsecond)
	return c, nil
}

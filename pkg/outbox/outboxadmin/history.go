package outboxadmin

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/headerjson"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
)

// HistoryEvent is one event of an aggregate as Admin.History reads it: where
// it is in its life and what the relays did with it so far.
type HistoryEvent struct {
	ID               int64
	AggregateVersion int64
	EventType        string
	// CreatedAt is its writer's transaction start: with ID, the message id
	// it is published under ([outbox.MessageID]).
	CreatedAt time.Time
	State     outbox.EventState
	// InFlight says a relay claimed the pending event and has not written
	// the outcome yet: it is being published, or its relay stopped while
	// publishing it and its lease has not expired.
	InFlight bool
	// Attempts counts the claims that handed the event to a relay.
	Attempts int
	// LastError is the last refusal or failure of its publishing; "" when
	// none was recorded. A published event no longer carries it.
	LastError string
	// NextAttemptAt is when a pending event is due (again); zero for the
	// other states.
	NextAttemptAt time.Time
	// Since is when the event reached State: published_at, dead_lettered_at
	// or discarded_at; zero while pending.
	Since time.Time
	// DeadLetteredAt is when it was dead-lettered, for a dead letter and a
	// discarded event; zero otherwise.
	DeadLetteredAt time.Time
	// Headers are the headers it is published with (the writer's, such as
	// a W3C traceparent).
	Headers map[string]string
}

// MessageID is the message id e is published under ([outbox.MessageID]).
func (e HistoryEvent) MessageID() string { return outbox.MessageID(e.ID, e.CreatedAt) }

// History returns the events of one aggregate in version order, each in its
// state, the most recent 1,000 of them; published events purged by
// retention (Admin.Purge, the relay's) are gone from it. It reads the
// aggregate's rows through an index of each table that can grow large
// (outbox, outbox_published), so its cost follows the aggregate's events, not
// the tables' size; it is meant for an operator's question about one
// aggregate.
func (a *Admin) History(ctx context.Context, aggregateType, aggregateID string) ([]HistoryEvent, error) {
	rows, err := a.db.Query(ctx, outboxsql.HistorySQL, aggregateType, aggregateID)
	if err != nil {
		return nil, fmt.Errorf("outbox history of %s %s: %w", aggregateType, aggregateID, err)
	}
	defer rows.Close()
	var out []HistoryEvent
	for rows.Next() {
		var (
			e                   HistoryEvent
			state               string
			lastError           *string
			next, since, deadAt pgtype.Timestamptz
			headers             []byte
		)
		if err := rows.Scan(&e.ID, &e.AggregateVersion, &e.EventType, &e.CreatedAt, &state, &e.InFlight,
			&e.Attempts, &lastError, &next, &since, &deadAt, &headers); err != nil {
			return nil, fmt.Errorf("outbox history of %s %s: %w", aggregateType, aggregateID, err)
		}
		e.State, e.NextAttemptAt, e.Since, e.DeadLetteredAt = outbox.EventState(state), next.Time, since.Time, deadAt.Time
		if lastError != nil {
			e.LastError = *lastError
		}
		if e.Headers, err = headerjson.Decode(headers); err != nil {
			return nil, fmt.Errorf("outbox history of %s %s: event %d's headers: %w", aggregateType, aggregateID, e.ID, err)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox history of %s %s: %w", aggregateType, aggregateID, err)
	}
	slices.Reverse(out)
	return out, nil
}

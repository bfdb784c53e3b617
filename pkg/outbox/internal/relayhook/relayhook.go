// Package relayhook carries what the relays of package outbox and its
// siblings share off the public API: the points of their protocol that
// tests, benchmarks and fault injection wait on, and the hand-over relay
// that package outboxwal runs.
//
// A relay reports a point to its outbox.Observer when that Observer also
// implements the point's interface below (Confirmed, BatchDone,
// Acknowledged). Their methods take types of this package, so no Observer
// outside this module implements them by accident.
package relayhook

import (
	"context"
	"log/slog"
)

// BatchResult is the outcome of one batch of the polling relay. Id slices
// are sorted.
type BatchResult struct {
	// Claimed is how many rows the batch leased.
	Claimed int
	// Published are the rows the broker confirmed and the relay marked (or
	// found already marked by another relay).
	Published []int64
	// Unmarked are rows the broker confirmed that could not be marked
	// (database error): they stay leased and are published again after the
	// lease.
	Unmarked []int64
	// Failed are rows whose attempt failed and got a backoff, DeadLettered
	// the ones that failed their last attempt.
	Failed       []int64
	DeadLettered []int64
	// NotSent are rows the publisher never sent; they are due again at
	// once, their attempt given back.
	NotSent []int64
	// Isolated are rows of a batch the broker refused without saying which
	// message it refused (outbox.ErrBatchRefused): each goes out alone next
	// time, at once, its attempt given back.
	Isolated []int64
	// Behind are rows sent after an earlier event of their aggregate in the
	// same batch that failed: whatever the broker said of them, they are not
	// marked, and go out again after that event, their attempt given back.
	Behind []int64
	// DeadLetteredAtClaim are due rows the claim dead-lettered instead of
	// handing them out, because they had MaxAttempts attempts already.
	DeadLetteredAtClaim []int64
	// Err is the database error that kept outcomes from being written, if
	// any.
	Err error
}

// IDs are the sorted ids of the rows a point is about.
type IDs []int64

// LSN is a position in the write-ahead log.
type LSN uint64

// Confirmed is told the ids the broker confirmed in a batch, before their
// rows are marked published (the polling relay) or swept (the WAL relay):
// the window where a crash makes the relay publish them again.
type Confirmed interface {
	Confirmed(ctx context.Context, ids IDs)
}

// BatchDone is told a non-empty batch's outcome once it was written (or
// writing it failed).
type BatchDone interface {
	BatchDone(ctx context.Context, r BatchResult)
}

// Acknowledged is told the position a WAL relay acknowledged in a standby
// status update.
type Acknowledged interface {
	Acknowledged(ctx context.Context, pos LSN)
}

// HandOver is implemented by the Publisher that package outboxwal gives
// outbox.NewRelay for its hand-over relay: that relay claims only the rows
// the WAL relay handed over to polling (the outbox table's handed_over
// column).
type HandOver interface {
	HandOverOnly(Token)
}

// Token is HandOver's argument, a type of this package.
type Token struct{}

// LogAttrs returns the attributes the relays log an event with, for slog's
// ...Context calls: event_id, aggregate_type, aggregate_id,
// aggregate_version, event_type and attempt.
func LogAttrs(id int64, aggregateType, aggregateID string, version int64, eventType string, attempt int) []any {
	return []any{
		slog.Int64("event_id", id),
		slog.String("aggregate_type", aggregateType),
		slog.String("aggregate_id", aggregateID),
		slog.Int64("aggregate_version", version),
		slog.String("event_type", eventType),
		slog.Int("attempt", attempt),
	}
}

package outbox

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// Envelope is an outbox row as the relay hands it to a Publisher.
type Envelope struct {
	// ID is the outbox row's id. Publishers send it as the message id (in
	// decimal): it is the consumer's deduplication key, stable across retries.
	ID int64
	// AggregateType and AggregateID name the entity the event is about.
	AggregateType string
	AggregateID   string
	// AggregateVersion is 1 for the aggregate's first event, then without gaps.
	AggregateVersion int64
	// EventType names what happened, e.g. "order.created".
	EventType string
	// Payload is the JSON body, as PostgreSQL's jsonb returns it (the enqueued
	// document, with whitespace and key order normalised).
	Payload []byte
	// Headers are the headers given to Enqueue (e.g. "traceparent"). Never nil.
	Headers map[string]string
	// CreatedAt is when the event was written to the outbox.
	CreatedAt time.Time
	// Attempt is 1 for the first publish attempt of this row, then 2, 3...
	Attempt int
}

// LogAttrs returns the attributes the relays log an event with, for
// slog's ...Context calls: event_id, aggregate_type, aggregate_id,
// aggregate_version, event_type and attempt.
func (e Envelope) LogAttrs() []any {
	return []any{
		slog.Int64("event_id", e.ID),
		slog.String("aggregate_type", e.AggregateType),
		slog.String("aggregate_id", e.AggregateID),
		slog.Int64("aggregate_version", e.AggregateVersion),
		slog.String("event_type", e.EventType),
		slog.Int("attempt", e.Attempt),
	}
}

// Publisher sends envelopes to a broker. The relay is its only caller; the
// contract below is what the relay's guarantees rest on, so a Publisher for
// another broker must keep every point of it.
//
//   - WaitReady blocks until the publisher can send (connected, not throttled by
//     the broker), reconnecting as needed, and returns nil; it returns an error
//     only when ctx ends or the publisher is closed. The relay calls it before
//     claiming rows, so a broker outage costs no attempt and no database work.
//
//   - PublishBatch sends every envelope and returns one error per envelope, in
//     order (len(result) == len(msgs)). nil means the broker took responsibility
//     for that message: it is durably stored and was routed to at least one queue
//     (for RabbitMQ: a positive publisher confirm, and no basic.return). Only then
//     does the relay mark the row published, so a nil that is not backed by the
//     broker's word loses the event.
//
//   - Any other outcome is an error: refused, unroutable (wrap ErrUnroutable),
//     connection lost before the verdict, ctx ended before the verdict. The
//     relay retries the row later; the broker may then hold the message twice,
//     which consumers absorb by deduplicating on the message id.
//
//   - An error wrapping ErrNotSent says the message never left the process, so
//     it cannot have reached the broker: the relay retries it at once without
//     counting an attempt. Never use it for a message that might have been sent.
//
//   - An error wrapping ErrBatchRefused says the broker refused one message of
//     the batch without saying which, and took the others without a verdict
//     down with it (RabbitMQ closes the channel, or the connection, on a
//     header of a type it refuses or a frame too large): the relay sends each
//     such message alone next time, without counting this attempt, and counts
//     the attempts of the one the broker refuses alone, until it is
//     dead-lettered. Use it only for a refusal the broker blames on a message
//     it was sent, not for an outage: it makes every message concerned go out
//     one per claim.
//
//   - Headers: a publisher sends Envelope.Headers with aggregate_type,
//     aggregate_id, event_type (strings) and aggregate_version (a 64-bit
//     integer) set from the envelope, over same-named entries; Enqueue's
//     MaxHeaderBytes measures that table. A publisher may send the envelope
//     in another format instead (outboxamqp's CloudEvents option sends the
//     attributes as cloudEvents_ headers, a few hundred bytes more than that
//     measure); it says so, and what it adds to the table.
//
//   - The envelopes of one batch belong to distinct aggregates, so they may be
//     sent concurrently; PublishBatch must return by the time ctx ends (the
//     relay's PublishTimeout), and must be safe for concurrent use: a relay runs
//     several batches at once.
type Publisher interface {
	WaitReady(ctx context.Context) error
	PublishBatch(ctx context.Context, msgs []Envelope) []error
}

var (
	// ErrNotSent marks a message the publisher did not hand to the broker at all
	// (not connected, throttled until the deadline). See Publisher.
	ErrNotSent = errors.New("outbox: message not sent")
	// ErrUnroutable marks a message the broker returned because no queue was
	// bound for it. It counts as a failed attempt: publishing to nowhere is not
	// publishing.
	ErrUnroutable = errors.New("outbox: message unroutable")
	// ErrBatchRefused marks a message without a verdict because the broker
	// refused some message of its batch, without saying which, and dropped
	// the channel or connection that carried them. See Publisher.
	ErrBatchRefused = errors.New("outbox: the broker refused a message of the batch")
)

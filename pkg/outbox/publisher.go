package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/relayhook"
)

// Envelope is an outbox row as the relay hands it to a Publisher.
type Envelope struct {
	// ID is the outbox row's id. Publishers send MessageID, built from it
	// and CreatedAt, as the message id.
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

// MessageID is the id a Publisher sends e under: the consumer's
// deduplication key, the same at every attempt. See MessageID (the function).
func (e Envelope) MessageID() string { return MessageID(e.ID, e.CreatedAt) }

// MessageID is the message id of the outbox row id written at createdAt:
// "<id>-<createdAt in microseconds since the Unix epoch>", both in decimal,
// e.g. "42-1764662400123456".
//
// The id alone is not enough. After a failover to an asynchronous standby,
// the standby's id sequence can be behind ids the old primary handed out to
// events that were published and then lost with it, and the next events get
// those ids again: a consumer deduplicating by the id would drop them as
// duplicates of events it applied before the failover. The row's creation
// time, which a later transaction on the new primary cannot share to the
// microsecond, tells them apart; and both are stored in the row, so every
// attempt, by any relay, sends the same id.
//
// Within one database, ordering message ids as byte strings orders them as
// their outbox ids' decimal forms (the '-' sorts before every digit).
func MessageID(id int64, createdAt time.Time) string {
	return strconv.FormatInt(id, 10) + "-" + strconv.FormatInt(createdAt.UnixMicro(), 10)
}

// ParseMessageID reads a message id made by MessageID: the outbox id and
// its creation time (UTC).
func ParseMessageID(s string) (id int64, createdAt time.Time, err error) {
	idPart, micros, _ := strings.Cut(s, "-")
	id, err = strconv.ParseInt(idPart, 10, 64)
	if err != nil || id <= 0 || strconv.FormatInt(id, 10) != idPart {
		return 0, time.Time{}, fmt.Errorf("outbox: message id %q: no outbox id in decimal", s)
	}
	us, err := strconv.ParseInt(micros, 10, 64)
	if err != nil || strconv.FormatInt(us, 10) != micros {
		return 0, time.Time{}, fmt.Errorf("outbox: message id %q: no creation time in microseconds", s)
	}
	return id, time.UnixMicro(us).UTC(), nil
}

// logAttrs returns the attributes the relays log e with.
func (e Envelope) logAttrs() []any {
	return relayhook.LogAttrs(e.ID, e.AggregateType, e.AggregateID, e.AggregateVersion, e.EventType, e.Attempt)
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
//   - Order: a batch may hold several envelopes of one aggregate (a run of
//     consecutive versions, see RelayConfig.BatchSize), in version order in
//     msgs. The publisher sends them in that order on one ordered path to
//     the broker (for AMQP, one channel), so that the broker keeps their
//     order; envelopes of distinct aggregates may be sent concurrently. The
//     relay marks an envelope only if every earlier one of its aggregate in
//     the batch got nil, so a verdict per envelope is all it needs.
//
//   - PublishBatch must return by the time ctx ends (the relay's
//     PublishTimeout), and must be safe for concurrent use: a relay runs
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

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
// The creation time keeps the id unique when identity values are handed out
// again: after a failover to an asynchronous standby whose sequence is behind
// the lost primary's, a restore, or a recreated outbox. Both are stored in the
// row, so every attempt, by any relay, sends the same id.
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
// relay's guarantees rest on this contract, so a Publisher for another broker
// must keep every point of it (package publishertest checks them):
//
//   - WaitReady blocks until the publisher can send (connected, not throttled),
//     reconnecting as needed, and returns nil; it returns an error only when
//     ctx ends or the publisher is closed. The relay calls it before claiming,
//     so a broker outage costs no attempt.
//   - PublishBatch returns one error per envelope, in order (len(result) ==
//     len(msgs)). nil means the broker durably stored the message and routed
//     it to at least one queue (RabbitMQ: a positive confirm, no
//     basic.return); only then is the row marked published.
//   - Any other outcome is an error (refused, unroutable: wrap
//     [ErrUnroutable], connection lost, ctx ended); the relay retries later.
//   - [ErrNotSent] says the message never left the process: retried at once,
//     without counting an attempt. Never use it for one that might have been
//     sent.
//   - [ErrBatchRefused] says the broker refused one message of the batch
//     without saying which and dropped the others with it (RabbitMQ closes the
//     channel or connection): each goes out alone next time, without counting
//     the attempt. Use it only for a refusal, never for an outage.
//   - Headers: send [Envelope.Headers] with aggregate_type, aggregate_id,
//     event_type (strings) and aggregate_version (a 64-bit integer) set from
//     the envelope, over same-named entries; [MaxHeaderBytes] measures that
//     table. A publisher using another format says what it adds.
//   - Order: envelopes of one aggregate (a run) come in version order and
//     must be sent in that order on one ordered path (AMQP: one channel);
//     distinct aggregates may go concurrently. A message the publisher
//     does not send (one it refuses itself) holds back the rest of its
//     run: [ErrNotSent] for each.
//   - PublishBatch returns by the time ctx ends ([RelayConfig.PublishTimeout])
//     and is safe for concurrent use.
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

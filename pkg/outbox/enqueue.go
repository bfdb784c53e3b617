package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
)

// ErrInvalidMessage is returned by Enqueue for a message that can never be
// published: a missing field, a payload that is not JSON, text PostgreSQL
// cannot store, a header the broker refuses, or a field over a limit of the
// broker's protocol (see MaxNameBytes, MaxHeaderBytes) or of the Writer
// (WriterConfig.MaxPayloadBytes). Nothing is written when it is returned.
var ErrInvalidMessage = errors.New("outbox: invalid message")

// Limits a message must keep, checked by Enqueue and Writer.Queue. They are
// the rules of AMQP 0-9-1 and RabbitMQ, computed here from the message alone
// (this package imports no AMQP client), because breaking them is not a failed
// publish but a protocol error: the broker or the client closes the channel,
// or the whole connection, failing every confirm in flight on it, at every
// retry. Checking them when the event is written turns that into an error in
// the business transaction instead. See the package doc, "What writers must
// do".
const (
	// MaxNameBytes bounds EventType, AggregateType and each header name. They
	// travel as AMQP short strings: the event type is the message's type
	// property and the default routing key, header names are the keys of the
	// headers table, and the aggregate type is what custom routing keys are
	// usually built from. A custom outboxamqp.Config.RoutingKey must keep its
	// result within this limit too.
	MaxNameBytes = 255
	// MaxHeaderBytes bounds a message's headers as the broker measures them:
	// the encoded AMQP field table a publisher sends, Headers plus the five
	// headers every publisher adds. The table must fit, with the other
	// properties, in the negotiated frame_max (RabbitMQ's default: 128 KiB);
	// 64 KiB leaves room for brokers configured down to about 65 KiB.
	MaxHeaderBytes = 64 << 10
	// DefaultMaxPayloadBytes is the default of WriterConfig.MaxPayloadBytes.
	DefaultMaxPayloadBytes = 1 << 20
)

// reservedHeader says whether a publisher sets the header name from the row
// (see Publisher), over a same-named entry of Message.Headers.
func reservedHeader(name string) bool {
	switch name {
	case "aggregate_type", "aggregate_id", "event_type", "aggregate_version", createdAtHeader:
		return true
	}
	return false
}

// refusedHeaderName says whether RabbitMQ reads the header itself and refuses
// it with a string value: it closes the channel with 406
// PRECONDITION_FAILED (unacceptable_type_in_header). CC and BCC name extra
// routing keys and must be arrays of strings, which a header of this
// package, a string, cannot be. (Names are compared as RabbitMQ does: "cc"
// is an ordinary header.)
func refusedHeaderName(name string) bool { return name == "CC" || name == "BCC" }

// headerBytes returns the size of m's headers as MaxHeaderBytes measures
// them: the encoded AMQP field table a publisher sends for m.
func headerBytes(m Message) int {
	n := 4 // the table's length
	entry := func(name string, value int) { n += 1 + len(name) + 1 + value }
	for k, v := range m.Headers {
		if !reservedHeader(k) {
			entry(k, 4+len(v))
		}
	}
	entry("aggregate_type", 4+len(m.AggregateType))
	entry("aggregate_id", 4+len(m.AggregateID))
	entry("event_type", 4+len(m.EventType))
	entry("aggregate_version", 8)
	entry(createdAtHeader, 4+len(time.RFC3339Nano)-5) // UTC: "Z", not "Z07:00"
	return n
}

// createdAtHeader is outboxamqp.HeaderCreatedAt: the row's creation time, to
// the microsecond (the AMQP timestamp has whole seconds).
const createdAtHeader = "outbox_created_at"

// Message is one event to publish. AggregateType and AggregateID name the entity
// the event is about; events of one aggregate are published in the order they
// were enqueued.
type Message struct {
	// AggregateType is the kind of entity, e.g. "order". Required, at most
	// MaxNameBytes.
	AggregateType string
	// AggregateID identifies the entity within its type. Required.
	AggregateID string
	// EventType names what happened, e.g. "order.created". Required, at most
	// MaxNameBytes.
	EventType string
	// Payload is the event body. It must be valid JSON that PostgreSQL's
	// jsonb stores (numbers within numeric's range, no \u0000, no lone UTF-16
	// surrogate), at most WriterConfig.MaxPayloadBytes as given and as
	// printed. It is stored as jsonb, so the relay publishes it normalised,
	// not byte for byte: numbers in positional notation (1e3 as 1000),
	// whitespace and key order change, and of duplicate keys only the last
	// one is kept. Required.
	Payload []byte
	// Headers travel with the message to the broker, e.g. W3C trace context
	// ("traceparent", "tracestate"), as long-string entries of its AMQP
	// headers table. Names are at most MaxNameBytes; "CC" and "BCC" are
	// refused (RabbitMQ reads them as lists of routing keys); an entry named
	// aggregate_type, aggregate_id, event_type or aggregate_version is
	// replaced by the publisher's. The whole
	// table, with the three fields above, must fit MaxHeaderBytes. Optional.
	Headers map[string]string
}

// Enqueued describes a message Writer.Enqueue or Writer.Queue wrote.
type Enqueued struct {
	// ID is the outbox row's id.
	ID int64
	// AggregateVersion is the message's position among its aggregate's events:
	// 1 for the first, then without gaps.
	AggregateVersion int64
	// CreatedAt is the row's created_at: the start of the transaction.
	CreatedAt time.Time
}

// MessageID is the message id publishers send the message under, the
// consumer's deduplication key (MessageID, the function).
func (e Enqueued) MessageID() string { return MessageID(e.ID, e.CreatedAt) }

// WriterConfig configures a Writer.
type WriterConfig struct {
	// NotifyChannel, when set, makes Enqueue issue a NOTIFY on that channel in the
	// same transaction, so relays in other processes wake up on commit. NOTIFY
	// takes a database-wide lock at commit time, which serialises the commits of
	// every writer that notifies, so it is off by default; relays then find new
	// rows through their in-process signal or their poll ticker. NOTIFY works
	// through a transaction-pooling PgBouncer (it is part of the transaction);
	// it is the relay's LISTEN that needs a session of its own. Default: "" (off).
	NotifyChannel string
	// MaxPayloadBytes bounds a message's Payload twice: in bytes as given to
	// Enqueue, and in bytes as the relays publish it, jsonb's text form, which
	// spells every number out digit by digit (a 22-byte 1e131071 prints as
	// 131,072 digits) and puts a space after each comma and colon. Enqueue
	// computes that form from the payload alone. The relay holds up to
	// Workers x BatchSize payloads in memory at once and every claim measures
	// them, so one huge event slows or stops the relay for everyone.
	// RabbitMQ's own limit (max_message_size) is 128 MiB by default.
	// Default: 0, meaning DefaultMaxPayloadBytes (1 MiB); -1: no limit of the
	// Writer's, but 256 MiB still bounds both (jsonb's own bound on a value).
	MaxPayloadBytes int
}

// Writer enqueues messages in the caller's transaction. The zero Writer is
// the one Enqueue uses: no NOTIFY, the default payload limit.
type Writer struct {
	notifyChannel string
	maxPayload    int // 0: DefaultMaxPayloadBytes; -1: none
}

// NewWriter returns a Writer for cfg.
func NewWriter(cfg WriterConfig) (*Writer, error) {
	if strings.ContainsRune(cfg.NotifyChannel, 0) || len(cfg.NotifyChannel) > 63 {
		return nil, fmt.Errorf("outbox: NotifyChannel %q: must be at most 63 bytes without NUL", cfg.NotifyChannel)
	}
	if cfg.MaxPayloadBytes < -1 {
		return nil, fmt.Errorf("outbox: MaxPayloadBytes %d: want -1 (no limit), 0 (default %d) or a number of bytes",
			cfg.MaxPayloadBytes, DefaultMaxPayloadBytes)
	}
	return &Writer{notifyChannel: cfg.NotifyChannel, maxPayload: cfg.MaxPayloadBytes}, nil
}

// Enqueue writes msgs with the zero Writer (no NOTIFY, payloads up to
// DefaultMaxPayloadBytes). See Writer.Enqueue, which also returns their ids.
func Enqueue(ctx context.Context, tx pgx.Tx, msgs ...Message) error {
	_, err := (&Writer{}).Enqueue(ctx, tx, msgs...)
	return err
}

// versionSQL bumps the aggregate's version. The upsert locks the aggregate's
// row in outbox_aggregates until the caller's transaction ends, so a second
// writer of the same aggregate waits, then gets the next version, and its row is
// inserted (and gets its id) only after the first writer committed or rolled
// back. The relay never updates this row, so it never conflicts with a writer's
// snapshot, whatever the writer's isolation level.
const versionSQL = `
INSERT INTO outbox_aggregates AS a (aggregate_type, aggregate_id, version)
VALUES ($1, $2, 1)
ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET version = a.version + 1`

// insertSQL inserts the row with the version versionSQL gave it. It is a
// statement of its own so that, at READ COMMITTED, its snapshot is taken after
// the aggregate's lock was granted and shows the previous writer's row.
//
// The row is blocked when the aggregate's previous event is still in outbox.
// That event is then locked FOR KEY SHARE until this transaction ends, and the
// relay cannot move it to outbox_published meanwhile (it locks it FOR UPDATE
// SKIP LOCKED): either it was gone before (this row is the aggregate's head), or
// the relay moves it after this commit and then unblocks this row. Only the
// writer of the next version locks an event, so one short transaction at most
// holds the relay back, never a queue of writers.
//
// At REPEATABLE READ or SERIALIZABLE the snapshot may predate the relay's move
// of the previous event, and locking a row changed since the snapshot fails
// with a serialization error: the row is inserted unblocked instead, and the
// claim's head check (see claimSQL) keeps the order.
const insertSQL = `
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, blocked)
SELECT $1, $2, a.version, $3, $4, $5,
       CASE WHEN current_setting('transaction_isolation') = 'read committed'
            THEN EXISTS (
                SELECT 1 FROM outbox p
                WHERE p.aggregate_type = $1 AND p.aggregate_id = $2 AND p.aggregate_version = a.version - 1
                FOR KEY SHARE)
            ELSE false END
FROM outbox_aggregates a
WHERE a.aggregate_type = $1 AND a.aggregate_id = $2
RETURNING id, aggregate_version, created_at`

// Enqueue writes msgs inside tx. They become visible to relays when tx commits,
// and disappear with it if it rolls back: the business change and its events
// are one atomic unit. Enqueue never talks to the broker.
//
// Every message is validated before anything is written; an invalid one makes
// Enqueue return an error wrapping ErrInvalidMessage and write nothing.
//
// Each message gets the next version of its aggregate. Writers of the same
// aggregate are serialised from that point until their transaction ends, so
// enqueue late in the transaction, after the business row is locked or written.
//
// Enqueue costs one round trip to PostgreSQL. To spend none of its own, queue
// the messages in the batch that carries the business change with Queue.
func (w *Writer) Enqueue(ctx context.Context, tx pgx.Tx, msgs ...Message) ([]Enqueued, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	batch := &pgx.Batch{}
	q, err := w.Queue(batch, msgs...)
	if err != nil {
		return nil, err
	}
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		return nil, fmt.Errorf("outbox enqueue: %w", err)
	}
	return q.Enqueued()
}

// Queued holds what Writer.Queue queued into a batch.
type Queued struct {
	out  []Enqueued
	read int
}

// Enqueued returns the messages' ids and versions, in the order they were
// queued. They are known once the batch's results were read without error
// (pgx.BatchResults.Close returned nil); before that, Enqueued returns an error.
func (q *Queued) Enqueued() ([]Enqueued, error) {
	if q.read != len(q.out) {
		return nil, fmt.Errorf("outbox enqueue: %d of %d messages written: read the batch's results first", q.read, len(q.out))
	}
	return q.out, nil
}

// Queue adds the statements that write msgs to b, a batch the caller sends
// itself, so the business change and its events reach PostgreSQL in one
// round trip:
//
//	b := &pgx.Batch{}
//	b.Queue(`INSERT INTO orders (id, total) VALUES ($1, $2)`, id, total)
//	q, err := writer.Queue(b, outbox.Message{AggregateType: "order", AggregateID: id, ...})
//	if err != nil { ... }                          // invalid message: b holds none of them
//	err = tx.SendBatch(ctx, b).Close()             // inside the business transaction
//	enqueued, err := q.Enqueued()
//
// Send b with tx.SendBatch inside the transaction of the business change (or
// with conn.SendBatch, which runs the whole batch as one implicit
// transaction). What Enqueue promises holds here too: validation before
// anything is queued, versions per aggregate, atomicity with the caller's
// transaction. Queue the messages after the statements that write or lock the
// business row; the aggregate's lock is taken when they run.
func (w *Writer) Queue(b *pgx.Batch, msgs ...Message) (*Queued, error) {
	headers := make([][]byte, len(msgs))
	for i, m := range msgs {
		if err := m.validate(w.maxPayload); err != nil {
			return nil, fmt.Errorf("%w: message %d: %w", ErrInvalidMessage, i, err)
		}
		h := m.Headers
		if h == nil {
			h = map[string]string{}
		}
		hb, err := json.Marshal(h)
		if err != nil {
			return nil, fmt.Errorf("%w: message %d: headers: %w", ErrInvalidMessage, i, err)
		}
		headers[i] = hb
	}
	q := &Queued{out: make([]Enqueued, len(msgs))}
	for i, m := range msgs {
		b.Queue(versionSQL, m.AggregateType, m.AggregateID)
		b.Queue(insertSQL, m.AggregateType, m.AggregateID, m.EventType, string(m.Payload), string(headers[i])).
			QueryRow(func(row pgx.Row) error {
				if err := row.Scan(&q.out[i].ID, &q.out[i].AggregateVersion, &q.out[i].CreatedAt); err != nil {
					return fmt.Errorf("insert outbox message %d: %w", i, err)
				}
				q.read++
				return nil
			})
	}
	if w.notifyChannel != "" && len(msgs) > 0 {
		b.Queue("SELECT pg_notify($1, '')", w.notifyChannel)
	}
	return q, nil
}

func (m Message) validate(maxPayload int) error {
	for _, f := range []struct {
		name, value string
		short       bool
	}{
		{"AggregateType", m.AggregateType, true},
		{"AggregateID", m.AggregateID, false},
		{"EventType", m.EventType, true},
	} {
		if f.value == "" {
			return fmt.Errorf("%s is empty", f.name)
		}
		if err := outboxsql.StorableText(f.value); err != nil {
			return fmt.Errorf("%s: %w", f.name, err)
		}
		if f.short && len(f.value) > MaxNameBytes {
			return fmt.Errorf("%s has %d bytes, more than the %d of an AMQP short string", f.name, len(f.value), MaxNameBytes)
		}
	}
	limit, what := maxPayloadTextBytes, "jsonb's bound on a value"
	switch {
	case maxPayload == 0:
		limit, what = DefaultMaxPayloadBytes, "WriterConfig.MaxPayloadBytes"
	case maxPayload > 0 && maxPayload < limit:
		limit, what = maxPayload, "WriterConfig.MaxPayloadBytes"
	}
	if len(m.Payload) > limit {
		return fmt.Errorf("Payload has %d bytes, more than the limit of %d (%s)", len(m.Payload), limit, what)
	}
	if !json.Valid(m.Payload) {
		return errors.New("Payload is not valid JSON")
	}
	text, err := jsonbTextSize(m.Payload)
	if err != nil {
		return fmt.Errorf("Payload: %w", err)
	}
	if text > int64(limit) {
		return fmt.Errorf("Payload takes %d bytes as the relays publish it (jsonb's text form: numbers written out digit by digit, a space after each comma and colon), more than the limit of %d (%s)", text, limit, what)
	}
	for k, v := range m.Headers {
		if err := outboxsql.StorableText(k); err != nil {
			return fmt.Errorf("header name %q: %w", k, err)
		}
		if len(k) > MaxNameBytes {
			return fmt.Errorf("header name %.40q... has %d bytes, more than the %d of an AMQP short string", k, len(k), MaxNameBytes)
		}
		if refusedHeaderName(k) {
			return fmt.Errorf("header %q: RabbitMQ takes it for a list of routing keys and closes the channel on a string value; use another name", k)
		}
		if err := outboxsql.StorableText(v); err != nil {
			return fmt.Errorf("header %q: %w", k, err)
		}
	}
	if n := headerBytes(m); n > MaxHeaderBytes {
		return fmt.Errorf("the headers take %d bytes as the broker measures them (an AMQP field table, with the publisher's aggregate_type, aggregate_id, event_type and aggregate_version), more than the limit of %d (MaxHeaderBytes)", n, MaxHeaderBytes)
	}
	return nil
}

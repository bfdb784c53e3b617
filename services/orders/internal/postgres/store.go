package postgres

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxotel"
	"github.com/outbox-inbox/reference/services/orders/internal/order"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/ordersdb"
)

// StoreConfig configures a Store.
type StoreConfig struct {
	// Writer enqueues the events. Default: outbox writer without NOTIFY.
	Writer *outbox.Writer
	// BeforeCommit, when set, runs in each write transaction after the order and
	// its outbox rows were written and before the commit; an error from it rolls
	// the transaction back. Tests use it to inject a failure at that point.
	BeforeCommit func(ctx context.Context, tx pgx.Tx) error
	// TracerProvider starts the write spans (orders.create, orders.cancel,
	// INTERNAL) and, for each event, its PRODUCER create span, whose context
	// is stored with the event. Default: a no-op provider: no spans, but a
	// trace context in ctx (the client's) is still stored with the event.
	TracerProvider trace.TracerProvider
	// Propagator writes the trace context and baggage into the event's
	// headers. Default: W3C Trace Context and Baggage.
	Propagator propagation.TextMapPropagator
	// EventDestination is where the events go (the exchange), for the create
	// span's name and messaging.destination.name. Default: "" (the span is
	// named "create").
	EventDestination string
	// BaggageKeys are the baggage members stored with an event (and so sent
	// to its consumers); the others are dropped. Default: none (no baggage
	// is stored).
	BaggageKeys []string
	// BaggageMaxBytes bounds the stored baggage's encoded size: members past
	// it are dropped. Default: DefaultBaggageMaxBytes.
	BaggageMaxBytes int
}

// DefaultBaggageMaxBytes is StoreConfig.BaggageMaxBytes' default.
const DefaultBaggageMaxBytes = 512

// Store reads and writes orders with the queries sqlc generates from
// queries.sql (package ordersdb). Every state change writes its event to the
// outbox in the same transaction: the generated queries run on the
// transaction (Queries.WithTx) and outbox.Writer writes the event on it.
type Store struct {
	pool         *pgxpool.Pool
	queries      *ordersdb.Queries
	writer       *outbox.Writer
	beforeCommit func(ctx context.Context, tx pgx.Tx) error
	tracer       trace.Tracer
	prop         propagation.TextMapPropagator
	destination  string
	baggageKeys  []string
	baggageMax   int
}

// TracerName is the instrumentation scope of the store's spans.
const TracerName = "github.com/outbox-inbox/reference/services/orders/internal/postgres"

// NewStore returns a Store on pool.
func NewStore(pool *pgxpool.Pool, cfg StoreConfig) *Store {
	w := cfg.Writer
	if w == nil {
		w, _ = outbox.NewWriter(outbox.WriterConfig{})
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	prop := cfg.Propagator
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	return &Store{pool: pool, queries: ordersdb.New(pool), writer: w, beforeCommit: cfg.BeforeCommit,
		tracer: tp.Tracer(TracerName), prop: prop, destination: cfg.EventDestination,
		baggageKeys: cfg.BaggageKeys, baggageMax: cmp.Or(cfg.BaggageMaxBytes, DefaultBaggageMaxBytes)}
}

// startWrite starts the (INTERNAL) span of a write transaction.
func (s *Store) startWrite(ctx context.Context, name string) (context.Context, trace.Span) {
	return s.tracer.Start(ctx, name)
}

// startCreate starts the PRODUCER span of an event's creation, a child of
// the write span in ctx, and returns the event's headers: headers with the
// create span's trace context and the allowed baggage (W3C traceparent,
// tracestate, baggage), the context its publish and its consumers link to.
// Without a span context (tracing off and no client context) none is added:
// no trace is invented.
func (s *Store) startCreate(ctx context.Context, eventType string, o order.Order, headers map[string]string) (trace.Span, map[string]string) {
	name := "create"
	if s.destination != "" {
		name += " " + s.destination
	}
	ctx, span := s.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		semconv.MessagingSystemRabbitMQ,
		semconv.MessagingOperationTypeCreate,
		semconv.MessagingOperationName("create"),
		semconv.MessagingDestinationName(s.destination),
		outboxotel.AttrAggregateType.String(order.AggregateType),
		outboxotel.AttrAggregateID.String(o.ID),
		outboxotel.AttrAggregateVersion.Int64(int64(o.Version)),
		outboxotel.AttrEventType.String(eventType),
	))
	if headers != nil {
		headers = maps.Clone(headers)
	}
	return span, outboxotel.InjectHeaders(outboxotel.LimitBaggage(ctx, s.baggageKeys, s.baggageMax), s.prop, headers)
}

// endSpan ends a span, recording err.
func endSpan(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// endCreate ends an event's create span with the enqueue's outcome and,
// the row written, messaging.message.id: the id the event is sent under.
func endCreate(span trace.Span, enqueued []outbox.Enqueued, err error) {
	if err == nil && len(enqueued) == 1 && span.IsRecording() {
		span.SetAttributes(semconv.MessagingMessageID(enqueued[0].MessageID()))
	}
	endSpan(span, err)
}

// endWrite ends a write span with the transaction's outcome.
func endWrite(span trace.Span, o order.Order, err error) {
	if span.IsRecording() {
		if o.ID != "" {
			span.SetAttributes(attrOrderID.String(o.ID), attrOrderVersion.Int64(int64(o.Version)))
		}
		// A client's mistake (no such order, a reused key) is the answer, not
		// a failure of the write.
		if err != nil && !errors.Is(err, order.ErrNotFound) && !errors.Is(err, order.ErrIdempotencyKeyReused) &&
			!errors.Is(err, order.ErrCancelled) {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
	}
	span.End()
}

// The write spans' attributes.
const (
	attrOrderID       = attribute.Key("orders.order.id")
	attrOrderVersion  = attribute.Key("orders.order.version")
	attrReplayed      = attribute.Key("orders.idempotent_replay")
	attrChanged       = attribute.Key("orders.changed")
	attrEventEnqueued = attribute.Key("outbox.event.type")
)

// Ping checks the database answers.
func (s *Store) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }

// fromRow converts a generated row to the API's order.
func fromRow(r ordersdb.Order) order.Order {
	return order.Order{
		ID: r.ID.String(), CustomerID: r.CustomerID, Currency: r.Currency, Items: r.Items, Total: r.Total,
		Status: r.Status, Version: r.Version, Note: r.Note, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
	}
}

// parseID turns an order id into the primary key's type, so the query finds
// the row through the key's index instead of comparing every row's id as
// text. An id that is not a UUID (36 characters, any case) names no order.
func parseID(id string) (uuid.UUID, error) {
	u, err := uuid.Parse(id)
	if err != nil || len(id) != 36 {
		return uuid.UUID{}, order.ErrNotFound
	}
	return u, nil
}

// Create stores a new order and its order.created event in one transaction.
// With an idempotency key already used for the same request, it returns the
// order that request created and replayed=true, writing nothing. With a key
// used for a different request it returns order.ErrIdempotencyKeyReused.
func (s *Store) Create(ctx context.Context, n order.NewOrder, idem order.Idempotency, headers map[string]string) (o order.Order, replayed bool, err error) {
	ctx, span := s.startWrite(ctx, "orders.create")
	defer func() {
		if span.IsRecording() {
			span.SetAttributes(attrReplayed.Bool(replayed))
			if err == nil && !replayed {
				span.SetAttributes(attrEventEnqueued.String(order.EventCreated))
			}
		}
		endWrite(span, o, err)
	}()
	create := func(tx pgx.Tx) error {
		o, replayed = order.Order{}, false
		if idem.Key == "" {
			return s.insert(ctx, tx, uuid.New(), n, headers, &o)
		}
		q := s.queries.WithTx(tx)
		// The insert waits on a concurrent transaction holding the same key,
		// so exactly one request creates the order. A retry finds the key
		// taken: it reads the hash and order id in a new statement, whose
		// snapshot sees the other transaction's commit.
		id, err := q.ClaimIdempotencyKey(ctx, ordersdb.ClaimIdempotencyKeyParams{Key: idem.Key, RequestHash: idem.RequestHash})
		if err == nil {
			return s.insert(ctx, tx, id, n, headers, &o)
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("claim idempotency key: %w", err)
		}
		taken, err := q.GetIdempotencyKey(ctx, idem.Key)
		if err != nil {
			return fmt.Errorf("read idempotency key: %w", err)
		}
		if !bytes.Equal(taken.RequestHash, idem.RequestHash) {
			return order.ErrIdempotencyKeyReused
		}
		row, err := q.GetOrder(ctx, taken.OrderID)
		if err != nil {
			return fmt.Errorf("load order of idempotency key: %w", err)
		}
		o, replayed = fromRow(row), true
		return nil
	}
	if mutantOrdersAckFirst {
		err = s.commitLater(ctx, create) // a planted bug: see mutant_orders_ackfirst.go
	} else {
		err = pgx.BeginFunc(ctx, s.pool, create)
	}
	if err != nil {
		return order.Order{}, false, err
	}
	return o, replayed, nil
}

// insert writes the order and its order.created event. The order is built
// here, id and timestamps included, so its event can be encoded before
// anything is sent, and the generated InsertOrder and the outbox's insert
// travel in one batch: one round trip for both.
func (s *Store) insert(ctx context.Context, tx pgx.Tx, id uuid.UUID, n order.NewOrder, headers map[string]string, o *order.Order) error {
	// PostgreSQL keeps microseconds: truncate so the event, the response and
	// later reads show the same instant.
	now := time.Now().UTC().Truncate(time.Microsecond)
	*o = order.Order{
		ID: id.String(), CustomerID: n.CustomerID, Currency: n.Currency, Items: n.Items, Total: n.Total,
		Status: order.StatusCreated, Version: 1, CreatedAt: now, UpdatedAt: now,
	}
	payload, err := order.CreatedEvent(*o)
	if err != nil {
		return fmt.Errorf("encode order.created: %w", err)
	}
	b := &pgx.Batch{}
	if err := ordersdb.New(batchQueue{b}).InsertOrder(ctx, ordersdb.InsertOrderParams{
		ID: id, CustomerID: o.CustomerID, Currency: o.Currency, Items: o.Items, Total: o.Total,
		Status: o.Status, Version: o.Version, CreatedAt: now,
	}); err != nil {
		return fmt.Errorf("queue order insert: %w", err)
	}
	create, headers := s.startCreate(ctx, order.EventCreated, *o, headers)
	q, err := s.writer.Queue(b, outbox.Message{
		AggregateType: order.AggregateType, AggregateID: o.ID, EventType: order.EventCreated,
		Payload: payload, Headers: headers,
	})
	if err != nil {
		err = fmt.Errorf("enqueue order.created: %w", err)
		endSpan(create, err)
		return err
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		err = fmt.Errorf("insert order and its order.created event: %w", err)
		endSpan(create, err)
		return err
	}
	enqueued, err := q.Enqueued()
	if err != nil {
		err = fmt.Errorf("order.created event: %w", err)
	}
	endCreate(create, enqueued, err)
	if err != nil {
		return err
	}
	return s.runBeforeCommit(ctx, tx)
}

// Get returns the order with id, or order.ErrNotFound.
func (s *Store) Get(ctx context.Context, id string) (order.Order, error) {
	key, err := parseID(id)
	if err != nil {
		return order.Order{}, err
	}
	row, err := s.queries.GetOrder(ctx, key)
	if errors.Is(err, pgx.ErrNoRows) {
		return order.Order{}, order.ErrNotFound
	}
	if err != nil {
		return order.Order{}, fmt.Errorf("get order: %w", err)
	}
	return fromRow(row), nil
}

// Cancel cancels the order with id and writes its order.cancelled event in the
// same transaction. Cancelling a cancelled order changes nothing and writes no
// event (changed=false). The order row is locked first, so concurrent cancels
// of one order produce one event.
func (s *Store) Cancel(ctx context.Context, id string, headers map[string]string) (o order.Order, changed bool, err error) {
	ctx, span := s.startWrite(ctx, "orders.cancel")
	defer func() {
		if span.IsRecording() {
			span.SetAttributes(attrChanged.Bool(changed))
			if err == nil && changed {
				span.SetAttributes(attrEventEnqueued.String(order.EventCancelled))
			}
		}
		endWrite(span, o, err)
	}()
	key, err := parseID(id)
	if err != nil {
		return order.Order{}, false, err
	}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		o, changed = order.Order{}, false
		q := s.queries.WithTx(tx)
		row, err := lockOrder(ctx, q, key)
		if err != nil {
			return err
		}
		if row.Status == order.StatusCancelled {
			o = fromRow(row)
			return nil
		}
		if row, err = q.CancelOrder(ctx, key); err != nil {
			return fmt.Errorf("cancel order: %w", err)
		}
		o = fromRow(row)
		payload, err := order.CancelledEvent(o)
		if err != nil {
			return fmt.Errorf("encode order.cancelled: %w", err)
		}
		if err := s.enqueueEvent(ctx, tx, order.EventCancelled, o, payload, headers); err != nil {
			return err
		}
		changed = true
		return s.runBeforeCommit(ctx, tx)
	})
	if err != nil {
		return order.Order{}, false, err
	}
	return o, changed, nil
}

// Amend gives the order with id its next version, with a's note, and writes
// its order.amended event in the same transaction. The key idem is required:
// an amendment already made under it (the client's retry) is returned with
// replayed=true and nothing is written, even if the order has moved on or
// been cancelled since; a key used for another note is
// order.ErrIdempotencyKeyReused. A cancelled order takes no new amendment
// (order.ErrCancelled). The order row is locked first, so concurrent
// amendments of one order make one version each, and two requests with one
// key one version between them.
func (s *Store) Amend(ctx context.Context, id string, a order.NewAmendment, idem order.Idempotency, headers map[string]string) (am order.Amendment, replayed bool, err error) {
	ctx, span := s.startWrite(ctx, "orders.amend")
	var o order.Order
	defer func() {
		if span.IsRecording() {
			span.SetAttributes(attrReplayed.Bool(replayed))
			if err == nil && !replayed {
				span.SetAttributes(attrEventEnqueued.String(order.EventAmended))
			}
		}
		endWrite(span, o, err)
	}()
	if idem.Key == "" {
		return order.Amendment{}, false, &order.ValidationError{Field: "Idempotency-Key", Message: "is required"}
	}
	key, err := parseID(id)
	if err != nil {
		return order.Amendment{}, false, err
	}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		am, replayed, o = order.Amendment{}, false, order.Order{}
		q := s.queries.WithTx(tx)
		row, err := lockOrder(ctx, q, key)
		if err != nil {
			return err
		}
		o = fromRow(row)
		// The key first: a retry of an amendment that committed is answered
		// with it whatever happened to the order since.
		prev, err := q.GetAmendment(ctx, ordersdb.GetAmendmentParams{OrderID: key, IdempotencyKey: idem.Key})
		switch {
		case err == nil:
			if !bytes.Equal(prev.RequestHash, idem.RequestHash) {
				return order.ErrIdempotencyKeyReused
			}
			am = order.Amendment{OrderID: o.ID, Version: prev.Version, Note: prev.Note, AmendedAt: prev.CreatedAt}
			replayed = true
			return nil
		case !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("read amendment of idempotency key: %w", err)
		}
		if row.Status == order.StatusCancelled {
			return order.ErrCancelled
		}
		if row, err = q.AmendOrder(ctx, ordersdb.AmendOrderParams{ID: key, Note: a.Note}); err != nil {
			return fmt.Errorf("amend order: %w", err)
		}
		o = fromRow(row)
		am = order.Amendment{OrderID: o.ID, Version: o.Version, Note: o.Note, AmendedAt: o.UpdatedAt}
		if err := q.InsertAmendment(ctx, ordersdb.InsertAmendmentParams{
			OrderID: key, IdempotencyKey: idem.Key, RequestHash: idem.RequestHash,
			Version: am.Version, Note: am.Note, CreatedAt: am.AmendedAt,
		}); err != nil {
			return fmt.Errorf("record amendment: %w", err)
		}
		payload, err := order.AmendedEvent(am)
		if err != nil {
			return fmt.Errorf("encode order.amended: %w", err)
		}
		if err := s.enqueueEvent(ctx, tx, order.EventAmended, o, payload, headers); err != nil {
			return err
		}
		return s.runBeforeCommit(ctx, tx)
	})
	if err != nil {
		return order.Amendment{}, false, err
	}
	return am, replayed, nil
}

// lockOrder locks the order row with key for the rest of tx, or returns
// order.ErrNotFound.
func lockOrder(ctx context.Context, q *ordersdb.Queries, key uuid.UUID) (ordersdb.Order, error) {
	row, err := q.LockOrder(ctx, key)
	if errors.Is(err, pgx.ErrNoRows) {
		return ordersdb.Order{}, order.ErrNotFound
	}
	if err != nil {
		return ordersdb.Order{}, fmt.Errorf("lock order: %w", err)
	}
	return row, nil
}

// enqueueEvent writes o's event of type eventType into the outbox in tx, the
// transaction that changed o, under a create span of its own.
func (s *Store) enqueueEvent(ctx context.Context, tx pgx.Tx, eventType string, o order.Order, payload []byte, headers map[string]string) error {
	create, headers := s.startCreate(ctx, eventType, o, headers)
	enqueued, err := s.writer.Enqueue(ctx, tx, outbox.Message{
		AggregateType: order.AggregateType, AggregateID: o.ID, EventType: eventType,
		Payload: payload, Headers: headers,
	})
	if err != nil {
		err = fmt.Errorf("enqueue %s: %w", eventType, err)
	}
	endCreate(create, enqueued, err)
	return err
}

func (s *Store) runBeforeCommit(ctx context.Context, tx pgx.Tx) error {
	if s.beforeCommit == nil {
		return nil
	}
	return s.beforeCommit(ctx, tx)
}

// errQueueOnly is what a batchQueue answers to a query that returns rows.
var errQueueOnly = errors.New("batch queue: only statements without results (sqlc :exec) can be queued")

// batchQueue is an ordersdb.DBTX that runs nothing: a generated :exec query
// called on it queues its statement and arguments into b, for the caller to
// send with other statements (the outbox's insert) in one round trip.
// Exec's result is known only once the batch's results are read.
type batchQueue struct{ b *pgx.Batch }

func (q batchQueue) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.b.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

func (batchQueue) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, errQueueOnly }

func (batchQueue) QueryRow(context.Context, string, ...any) pgx.Row { return errRow{} }

type errRow struct{}

func (errRow) Scan(...any) error { return errQueueOnly }

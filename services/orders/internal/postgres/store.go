package postgres

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/order"
)

// Idempotency identifies a client's request across retries. The zero value
// means the client sent no Idempotency-Key.
type Idempotency struct {
	Key         string
	RequestHash []byte
}

// StoreConfig configures a Store.
type StoreConfig struct {
	// Writer enqueues the events. Default: outbox writer without NOTIFY.
	Writer *outbox.Writer
	// BeforeCommit, when set, runs in each write transaction after the order and
	// its outbox rows were written and before the commit; an error from it rolls
	// the transaction back. Tests use it to inject a failure at that point.
	BeforeCommit func(ctx context.Context, tx pgx.Tx) error
}

// Store reads and writes orders. Every state change writes its event to the
// outbox in the same transaction.
type Store struct {
	pool         *pgxpool.Pool
	writer       *outbox.Writer
	beforeCommit func(ctx context.Context, tx pgx.Tx) error
}

// NewStore returns a Store on pool.
func NewStore(pool *pgxpool.Pool, cfg StoreConfig) *Store {
	w := cfg.Writer
	if w == nil {
		w, _ = outbox.NewWriter(outbox.WriterConfig{})
	}
	return &Store{pool: pool, writer: w, beforeCommit: cfg.BeforeCommit}
}

// Ping checks the database answers.
func (s *Store) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }

const orderColumns = `id::text, customer_id, currency, items, total, status, version, created_at, updated_at`

func scanOrder(row pgx.Row) (order.Order, error) {
	var o order.Order
	err := row.Scan(&o.ID, &o.CustomerID, &o.Currency, &o.Items, &o.Total, &o.Status, &o.Version, &o.CreatedAt, &o.UpdatedAt)
	return o, err
}

// Create stores a new order and its order.created event in one transaction.
// With an idempotency key already used for the same request, it returns the
// order that request created and replayed=true, writing nothing. With a key
// used for a different request it returns order.ErrIdempotencyKeyReused.
func (s *Store) Create(ctx context.Context, n order.NewOrder, idem Idempotency, headers map[string]string) (o order.Order, replayed bool, err error) {
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		o, replayed = order.Order{}, false
		if idem.Key != "" {
			// The insert waits on a concurrent transaction holding the same key,
			// so exactly one request creates the order.
			// A retry finds the key taken: it reads the hash and order id in a
			// new statement, whose snapshot sees the other transaction's commit.
			var existingHash []byte
			var existingID string
			err := tx.QueryRow(ctx, `
				INSERT INTO idempotency_keys (key, request_hash, order_id)
				VALUES ($1, $2, gen_random_uuid())
				ON CONFLICT (key) DO NOTHING
				RETURNING order_id::text`, idem.Key, idem.RequestHash).Scan(&existingID)
			if errors.Is(err, pgx.ErrNoRows) {
				err = tx.QueryRow(ctx, `SELECT request_hash, order_id::text FROM idempotency_keys WHERE key = $1`,
					idem.Key).Scan(&existingHash, &existingID)
			}
			if err != nil {
				return fmt.Errorf("claim idempotency key: %w", err)
			}
			if existingHash != nil {
				if !bytes.Equal(existingHash, idem.RequestHash) {
					return order.ErrIdempotencyKeyReused
				}
				o, err = scanOrder(tx.QueryRow(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = $1`, existingID))
				if err != nil {
					return fmt.Errorf("load order of idempotency key: %w", err)
				}
				replayed = true
				return nil
			}
			return s.insert(ctx, tx, existingID, n, headers, &o)
		}
		return s.insert(ctx, tx, "", n, headers, &o)
	})
	if err != nil {
		return order.Order{}, false, err
	}
	return o, replayed, nil
}

// insertOrderSQL writes a new order. Create sends it in one batch with the
// order.created event, so the order and its outbox row cost one round trip.
const insertOrderSQL = `
	INSERT INTO orders (id, customer_id, currency, items, total, status, version, created_at, updated_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)`

// insert writes the order (id, or a new one when empty) and its order.created
// event. The order is built here, id and timestamps included, so its event can
// be encoded before anything is sent and both statements share a round trip.
func (s *Store) insert(ctx context.Context, tx pgx.Tx, id string, n order.NewOrder, headers map[string]string, o *order.Order) error {
	if id == "" {
		id = uuid.NewString()
	}
	// PostgreSQL keeps microseconds: truncate so the event, the response and
	// later reads show the same instant.
	now := time.Now().UTC().Truncate(time.Microsecond)
	*o = order.Order{
		ID: id, CustomerID: n.CustomerID, Currency: n.Currency, Items: n.Items, Total: n.Total,
		Status: order.StatusCreated, Version: 1, CreatedAt: now, UpdatedAt: now,
	}
	payload, err := order.CreatedEvent(*o)
	if err != nil {
		return fmt.Errorf("encode order.created: %w", err)
	}
	b := &pgx.Batch{}
	b.Queue(insertOrderSQL, o.ID, o.CustomerID, o.Currency, o.Items, o.Total, o.Status, o.Version, o.CreatedAt)
	if _, err := s.writer.Queue(b, outbox.Message{
		AggregateType: order.AggregateType, AggregateID: o.ID, EventType: order.EventCreated,
		Payload: payload, Headers: headers,
	}); err != nil {
		return fmt.Errorf("enqueue order.created: %w", err)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("insert order and its order.created event: %w", err)
	}
	return s.runBeforeCommit(ctx, tx)
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

// Get returns the order with id, or order.ErrNotFound.
func (s *Store) Get(ctx context.Context, id string) (order.Order, error) {
	key, err := parseID(id)
	if err != nil {
		return order.Order{}, err
	}
	o, err := scanOrder(s.pool.QueryRow(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = $1`, key))
	if errors.Is(err, pgx.ErrNoRows) {
		return order.Order{}, order.ErrNotFound
	}
	if err != nil {
		return order.Order{}, fmt.Errorf("get order: %w", err)
	}
	return o, nil
}

// Cancel cancels the order with id and writes its order.cancelled event in the
// same transaction. Cancelling a cancelled order changes nothing and writes no
// event (changed=false). The order row is locked first, so concurrent cancels
// of one order produce one event.
func (s *Store) Cancel(ctx context.Context, id string, headers map[string]string) (o order.Order, changed bool, err error) {
	key, err := parseID(id)
	if err != nil {
		return order.Order{}, false, err
	}
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		o, changed = order.Order{}, false
		var err error
		o, err = scanOrder(tx.QueryRow(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = $1 FOR UPDATE`, key))
		if errors.Is(err, pgx.ErrNoRows) {
			return order.ErrNotFound
		}
		if err != nil {
			return fmt.Errorf("lock order: %w", err)
		}
		if o.Status == order.StatusCancelled {
			return nil
		}
		o, err = scanOrder(tx.QueryRow(ctx, `
			UPDATE orders SET status = 'cancelled', version = version + 1, updated_at = now()
			WHERE id = $1 RETURNING `+orderColumns, key))
		if err != nil {
			return fmt.Errorf("cancel order: %w", err)
		}
		payload, err := order.CancelledEvent(o)
		if err != nil {
			return fmt.Errorf("encode order.cancelled: %w", err)
		}
		if _, err := s.writer.Enqueue(ctx, tx, outbox.Message{
			AggregateType: order.AggregateType, AggregateID: o.ID, EventType: order.EventCancelled,
			Payload: payload, Headers: headers,
		}); err != nil {
			return fmt.Errorf("enqueue order.cancelled: %w", err)
		}
		changed = true
		return s.runBeforeCommit(ctx, tx)
	})
	if err != nil {
		return order.Order{}, false, err
	}
	return o, changed, nil
}

func (s *Store) runBeforeCommit(ctx context.Context, tx pgx.Tx) error {
	if s.beforeCommit == nil {
		return nil
	}
	return s.beforeCommit(ctx, tx)
}

func nullIfEmpty(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

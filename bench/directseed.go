package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// seedDirect is the only code of the benchmark that writes the outbox tables
// without package outbox. Everything else goes through the package: pending
// events through Enqueue (or Writer.Queue), publishing and moving through the
// relays, purging through their retention. The states seeded here are ones
// no API of the package makes in a time a benchmark can spend:
//
//   - reset: empty tables with no dead tuples, so each repetition starts from
//     the same physical state (TRUNCATE; the package deletes row by row);
//   - pendingOrders: a backlog of up to 100,000 events, as Enqueue leaves
//     them while no relay runs, written with COPY;
//   - pendingRows: a backlog of 1,000,000 pending rows, in one statement;
//   - publishedOrders: up to 1,000,000 orders whose order.created the relay
//     published over the last 7.7 days, in two statements (only the relays
//     write outbox_published, one confirmed event at a time).
//
// Each writes the rows as the package's own writes leave them (schema.sql
// describes the columns); a schema version that changes that changes this
// file too.
type seedDirect struct{ db seedDB }

// seedDB is a pool or one of its connections.
type seedDB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// reset empties the outbox tables. TRUNCATE leaves no dead tuples, so each
// repetition starts from the same physical state.
func (s seedDirect) reset(ctx context.Context) error {
	_, err := s.db.Exec(ctx, "TRUNCATE outbox, outbox_published, outbox_aggregates")
	if err != nil {
		return fmt.Errorf("truncate outbox tables: %w", err)
	}
	_, err = s.db.Exec(ctx, "ANALYZE outbox, outbox_published, outbox_aggregates")
	return err
}

// freshBacklog empties the outbox tables, writes n pending orders
// (pendingOrders) and analyzes the tables: the start of each drain.
func (s seedDirect) freshBacklog(ctx context.Context, n int) error {
	if err := s.reset(ctx); err != nil {
		return err
	}
	if err := s.pendingOrders(ctx, n); err != nil {
		return err
	}
	_, err := s.db.Exec(ctx, "ANALYZE outbox, outbox_aggregates")
	return err
}

// seedPendingOrders is seedDirect.pendingOrders as a seeding function, for
// the figures that take one.
func seedPendingOrders(ctx context.Context, pool *pgxpool.Pool, n int) error {
	return (seedDirect{pool}).pendingOrders(ctx, n)
}

// pendingOrders writes n pending order.created events, one per order (random
// ids, the orders service's payload and a traceparent header), with COPY:
// the state Enqueue leaves after n orders were created while no relay ran.
func (s seedDirect) pendingOrders(ctx context.Context, n int) error {
	now := time.Now()
	aggs := make([][]any, n)
	rows := make([][]any, n)
	for i := range n {
		id := newUUID()
		h, _ := json.Marshal(traceHeaders())
		aggs[i] = []any{aggregateType, id, int64(1)}
		rows[i] = []any{aggregateType, id, int64(1), eventCreated, string(createdEvent(id, i, now)), string(h)}
	}
	return pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"outbox_aggregates"},
			[]string{"aggregate_type", "aggregate_id", "version"}, pgx.CopyFromRows(aggs)); err != nil {
			return fmt.Errorf("seed outbox_aggregates: %w", err)
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"outbox"},
			[]string{"aggregate_type", "aggregate_id", "aggregate_version", "event_type", "payload", "headers"}, pgx.CopyFromRows(rows)); err != nil {
			return fmt.Errorf("seed outbox: %w", err)
		}
		return nil
	})
}

// pendingRowsSQL fills the outbox with $1 rows as Enqueue writes them for
// one order.created each (pending, never claimed, created over the last
// hour), in one statement. The ids grow with the aggregate ids, so every
// index is appended to: quick to set up. (Status, which reads them, never
// reads outbox_aggregates: no rows there.)
const pendingRowsSQL = `
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at)
SELECT 'order', 'o-' || lpad(g::text, 8, '0'), 1, 'order.created',
       '{"customer_id": "c-42", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}], "total": 2500}',
       '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}',
       now() - interval '1 hour' + g * interval '1 millisecond'
FROM generate_series(1, $1::bigint) g`

// pendingRows writes n pending rows with pendingRowsSQL.
func (s seedDirect) pendingRows(ctx context.Context, n int) error {
	if _, err := s.db.Exec(ctx, pendingRowsSQL, n); err != nil {
		return fmt.Errorf("seed %d pending rows: %w", n, err)
	}
	return nil
}

// publishedOrdersSQL writes $1 published rows: the history of $1 orders
// whose order.created was published over the last 7.7 days, oldest first,
// so a 7-day retention purges about a tenth of them.
const publishedOrdersSQL = `
INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                              payload, headers, created_at, attempts, published_at)
SELECT g, 'order', agg, 1, 'order.created',
       jsonb_build_object('order_id', agg, 'customer_id', 'c-' || (g % 1000), 'currency', 'EUR',
                          'items', '[{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]'::jsonb,
                          'total', 2500, 'created_at', at),
       jsonb_build_object('traceparent', '00-' || md5(agg) || '-' || left(md5(at::text), 16) || '-01'),
       at, 1, at + interval '20 milliseconds'
FROM (SELECT g, md5(g::text)::uuid::text AS agg,
             now() - interval '7.7 days' * (1 - g::float8 / $1) AS at
      FROM generate_series(1, $1::bigint) g) s`

// publishedAggregatesSQL records those orders as aggregates at version 1.
const publishedAggregatesSQL = `
INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, version)
SELECT 'order', md5(g::text)::uuid::text, 1 FROM generate_series(1, $1::bigint) g`

// publishedOrders writes the history of n orders published over the last
// 7.7 days (publishedOrdersSQL, publishedAggregatesSQL) into empty tables,
// moves the outbox's ids past it, as they would have moved, and analyzes
// the tables.
func (s seedDirect) publishedOrders(ctx context.Context, n int) error {
	for _, q := range []struct {
		what string
		sql  string
		args []any
	}{
		{"published events", publishedOrdersSQL, []any{n}},
		{"their aggregates", publishedAggregatesSQL, []any{n}},
		{"the outbox's next id", fmt.Sprintf("ALTER TABLE outbox ALTER COLUMN id RESTART WITH %d", n+1), nil},
		{"statistics", "ANALYZE outbox_published, outbox_aggregates", nil},
	} {
		if _, err := s.db.Exec(ctx, q.sql, q.args...); err != nil {
			return fmt.Errorf("seed the history of %d orders: %s: %w", n, q.what, err)
		}
	}
	return nil
}

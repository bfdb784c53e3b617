package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// ordersSchemaPath is the orders service's own schema. The benchmark cannot
// import services/orders/internal/postgres (Go's internal rule), so it reads
// the file and runs the same transaction shape as Store.Create.
const ordersSchemaPath = "services/orders/internal/postgres/schema.sql"

// ordersQueriesPath holds the queries sqlc generates the orders store's code
// from (services/orders/internal/postgres/ordersdb).
const ordersQueriesPath = "services/orders/internal/postgres/queries.sql"

// insertOrderSQL is the InsertOrder query of ordersQueriesPath, which
// Store.Create sends; TestInsertOrderSQLIsTheStores fails when they differ.
const insertOrderSQL = `
	INSERT INTO orders (id, customer_id, currency, items, total, status, version, created_at, updated_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)`

// createOrder runs Store.Create's transaction for an order without an
// Idempotency-Key: the order built by the client, then one batch with its
// INSERT and, when w is not nil, its order.created event queued by w, then the
// commit. It returns the order id and the commit time.
func createOrder(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, n int) (string, time.Time, error) {
	id := newUUID()
	customer := fmt.Sprintf("c-%d", n%1000)
	now := time.Now().UTC().Truncate(time.Microsecond)
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		b.Queue(insertOrderSQL, id, customer, "EUR", benchItems, int64(2500), "created", int64(1), now)
		if w != nil {
			payload, err := json.Marshal(createdPayload{
				OrderID: id, CustomerID: customer, Currency: "EUR", Items: benchItems, Total: 2500, CreatedAt: now,
			})
			if err != nil {
				return err
			}
			if _, err := w.Queue(b, outbox.Message{
				AggregateType: aggregateType, AggregateID: id, EventType: eventCreated,
				Payload: payload, Headers: untracedWriteHeaders(ctx),
			}); err != nil {
				return err
			}
		}
		return tx.SendBatch(ctx, b).Close()
	})
	return id, time.Now(), err
}

// migrateOrders applies the orders service's schema and the outbox schema, as
// the service does at start.
func (b *bench) migrateOrders(ctx context.Context, pool *pgxpool.Pool) error {
	schema, err := os.ReadFile(filepath.Join(b.env.root, ordersSchemaPath))
	if err != nil {
		return fmt.Errorf("read the orders schema: %w", err)
	}
	if _, err := pool.Exec(ctx, string(schema)); err != nil {
		return fmt.Errorf("apply the orders schema: %w", err)
	}
	return outbox.Migrate(ctx, pool)
}

// runWriteOverhead measures write_overhead: the latency of creating an order
// with its outbox row, against the same transaction without it. One client,
// sequential transactions; the arms alternate in small blocks so background
// noise lands on all of them alike.
func (b *bench) runWriteOverhead(ctx context.Context) ([]Figure, error) {
	_, pool, err := b.env.openDatabase(ctx, "write", b.migrateOrders)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	plainWriter, err := outbox.NewWriter(outbox.WriterConfig{})
	if err != nil {
		return nil, err
	}
	notifyWriter, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: notifyChannel})
	if err != nil {
		return nil, err
	}

	type arm struct {
		name   string
		create func(n int) error
		lat    []time.Duration
	}
	withWriter := func(w *outbox.Writer) func(int) error {
		return func(n int) error {
			_, _, err := createOrder(ctx, pool, w, n)
			return err
		}
	}
	arms := []arm{
		{name: "no_outbox", create: withWriter(nil)},
		{name: "outbox", create: withWriter(plainWriter)},
		{name: "outbox_notify", create: withWriter(notifyWriter)},
	}
	const block = 50
	warmup := min(200, b.cfg.writeOrders/5)
	n := 0
	for done := -warmup; done < b.cfg.writeOrders; done += block {
		for i := range arms {
			for range block {
				n++
				start := time.Now()
				if err := arms[i].create(n); err != nil {
					return nil, fmt.Errorf("%s: %w", arms[i].name, err)
				}
				if done >= 0 {
					arms[i].lat = append(arms[i].lat, time.Since(start))
				}
			}
		}
	}

	sums := map[string]Latencies{}
	details := map[string]any{"orders_per_arm": b.cfg.writeOrders, "clients": 1, "block": block}
	for _, a := range arms {
		s, err := summarize(a.lat)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		sums[a.name] = s
		details[a.name] = map[string]float64{"p50_ms": ms(s.P50), "p90_ms": ms(s.P90), "p99_ms": ms(s.P99), "max_ms": ms(s.Max)}
	}
	base := sums["no_outbox"]
	baseIs := "the same transaction (BEGIN, one batch with the order's INSERT, COMMIT) without the event"
	measuresFmt := "%s latency of Store.Create's transaction (BEGIN, one batch with the order's INSERT and its order.created event%s, COMMIT), one client, %d orders"
	notify, plain := sums["outbox_notify"], sums["outbox"]
	return []Figure{
		newFigure("write_overhead_p50", "ms", ms(plain.P50), ms(base.P50), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p50", ", no NOTIFY: the service's default with its in-process relay", b.cfg.writeOrders), baseIs, details),
		newFigure("write_overhead_p99", "ms", ms(plain.P99), ms(base.P99), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p99", ", no NOTIFY: the service's default with its in-process relay", b.cfg.writeOrders), baseIs, nil),
		newFigure("write_overhead_notify_p50", "ms", ms(notify.P50), ms(base.P50), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p50", " and a NOTIFY: the service's default with RELAY=false, relays in other processes", b.cfg.writeOrders), baseIs, nil),
		newFigure("write_overhead_notify_p99", "ms", ms(notify.P99), ms(base.P99), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p99", " and a NOTIFY: the service's default with RELAY=false, relays in other processes", b.cfg.writeOrders), baseIs, nil),
	}, nil
}

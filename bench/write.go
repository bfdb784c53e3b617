package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// ordersSchemaPath is the orders service's own schema. The benchmark cannot
// import services/orders/internal/postgres (Go's internal rule), so it reads
// the file and runs the same transaction shape as Store.Create.
const ordersSchemaPath = "services/orders/internal/postgres/schema.sql"

// insertOrderSQL is the INSERT of Store.insert (services/orders/internal/postgres/store.go).
const insertOrderSQL = `
		INSERT INTO orders (id, customer_id, currency, items, total, status)
		VALUES (coalesce($1::uuid, gen_random_uuid()), $2, $3, $4, $5, 'created')
		RETURNING id::text, customer_id, currency, items, total, status, version, created_at, updated_at`

type benchOrder struct {
	ID, CustomerID, Currency, Status string
	Items                            []orderItem
	Total, Version                   int64
	CreatedAt, UpdatedAt             time.Time
}

// createOrder runs Store.Create's transaction for an order without an
// Idempotency-Key: insert the order, then, when w is not nil, enqueue its
// order.created event, then commit. It returns the commit time.
func createOrder(ctx context.Context, pool *pgxpool.Pool, w *outbox.Writer, n int) (string, time.Time, error) {
	var o benchOrder
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, insertOrderSQL, nil, fmt.Sprintf("c-%d", n%1000), "EUR", benchItems, int64(2500)).
			Scan(&o.ID, &o.CustomerID, &o.Currency, &o.Items, &o.Total, &o.Status, &o.Version, &o.CreatedAt, &o.UpdatedAt)
		if err != nil {
			return fmt.Errorf("insert order: %w", err)
		}
		if w == nil {
			return nil
		}
		payload, err := json.Marshal(createdPayload{
			OrderID: o.ID, CustomerID: o.CustomerID, Currency: o.Currency,
			Items: o.Items, Total: o.Total, CreatedAt: o.CreatedAt.UTC(),
		})
		if err != nil {
			return err
		}
		_, err = w.Enqueue(ctx, tx, outbox.Message{
			AggregateType: aggregateType, AggregateID: o.ID, EventType: eventCreated,
			Payload: payload, Headers: traceHeaders(),
		})
		return err
	})
	return o.ID, time.Now(), err
}

// enqueueCapture is a pgx tracer that records the first statement Enqueue
// sends, with its arguments, so the pipelined diagnostic can send exactly
// that statement in the same round trip as the order's INSERT.
type enqueueCapture struct {
	mu   sync.Mutex
	sql  string
	args []any
}

func (c *enqueueCapture) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *enqueueCapture) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sql == "" && strings.Contains(d.SQL, "INSERT INTO outbox ") {
		c.sql, c.args = d.SQL, slices.Clone(d.Args)
	}
}

func (c *enqueueCapture) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *enqueueCapture) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (c *enqueueCapture) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// pipelinedStatement returns Enqueue's statement if its arguments are, in
// order, the message's aggregate type, aggregate id, event type, payload and
// headers as the benchmark passed them; "" otherwise (the diagnostic is then
// skipped).
func (c *enqueueCapture) pipelinedStatement(m outbox.Message) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	h, _ := json.Marshal(m.Headers)
	want := []string{m.AggregateType, m.AggregateID, m.EventType, string(m.Payload), string(h)}
	if len(c.args) != len(want) {
		return ""
	}
	for i, a := range c.args {
		if s, ok := a.(string); !ok || s != want[i] {
			return ""
		}
	}
	return c.sql
}

// createOrderPipelined is the diagnostic for the change proposed for
// Store.Create: the order id and created_at are made by the client, so the
// order's INSERT and the outbox statement go in one round trip.
func createOrderPipelined(ctx context.Context, pool *pgxpool.Pool, enqueueSQL string, n int) error {
	id := newUUID()
	now := time.Now().UTC().Truncate(time.Microsecond)
	payload, err := json.Marshal(createdPayload{OrderID: id, CustomerID: fmt.Sprintf("c-%d", n%1000), Currency: "EUR",
		Items: benchItems, Total: 2500, CreatedAt: now})
	if err != nil {
		return err
	}
	headers, _ := json.Marshal(traceHeaders())
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var o benchOrder
		b := &pgx.Batch{}
		b.Queue(insertOrderSQL, id, fmt.Sprintf("c-%d", n%1000), "EUR", benchItems, int64(2500)).QueryRow(func(r pgx.Row) error {
			return r.Scan(&o.ID, &o.CustomerID, &o.Currency, &o.Items, &o.Total, &o.Status, &o.Version, &o.CreatedAt, &o.UpdatedAt)
		})
		b.Queue(enqueueSQL, aggregateType, id, eventCreated, string(payload), string(headers))
		return tx.SendBatch(ctx, b).Close()
	})
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
	poolCfg, err := b.env.newDatabase(ctx, "write")
	if err != nil {
		return nil, err
	}
	poolCfg.MaxConns = 2
	capture := &enqueueCapture{}
	poolCfg.ConnConfig.Tracer = capture
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	if err := b.migrateOrders(ctx, pool); err != nil {
		return nil, err
	}
	plainWriter, err := outbox.NewWriter(outbox.WriterConfig{})
	if err != nil {
		return nil, err
	}
	notifyWriter, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: notifyChannel})
	if err != nil {
		return nil, err
	}

	// Let Enqueue show its statement, for the pipelined diagnostic.
	probe := outbox.Message{AggregateType: aggregateType, AggregateID: newUUID(), EventType: eventCreated,
		Payload: []byte(`{"probe": true}`), Headers: map[string]string{"traceparent": "probe"}}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := plainWriter.Enqueue(ctx, tx, probe)
		return err
	}); err != nil {
		return nil, fmt.Errorf("probe Enqueue: %w", err)
	}
	enqueueSQL := capture.pipelinedStatement(probe)

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
	if enqueueSQL != "" {
		arms = append(arms, arm{name: "outbox_pipelined_diagnostic", create: func(n int) error {
			return createOrderPipelined(ctx, pool, enqueueSQL, n)
		}})
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
	details := map[string]any{"orders_per_arm": b.cfg.writeOrders, "clients": 1, "block": block,
		"pipelined_diagnostic": "outbox_pipelined_diagnostic is not the service's code: the order id and created_at made by the client, the order INSERT and Enqueue's own statement sent in one round trip (the change proposed for Store.Create)"}
	if enqueueSQL == "" {
		details["pipelined_diagnostic"] = "skipped: Enqueue's statement or its arguments changed shape"
	}
	for _, a := range arms {
		s, err := summarize(a.lat)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		sums[a.name] = s
		details[a.name] = map[string]float64{"p50_ms": ms(s.P50), "p90_ms": ms(s.P90), "p99_ms": ms(s.P99), "max_ms": ms(s.Max)}
	}
	base := sums["no_outbox"]
	baseIs := "the same transaction (BEGIN, INSERT order RETURNING, COMMIT) without the Enqueue"
	measuresFmt := "%s latency of Store.Create's transaction (BEGIN, INSERT order RETURNING, Enqueue order.created%s, COMMIT), one client, %d orders"
	notify, plain := sums["outbox_notify"], sums["outbox"]
	return []Figure{
		newFigure("write_overhead_p50", "ms", ms(notify.P50), ms(base.P50), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p50", " with NOTIFY, the service's default", b.cfg.writeOrders), baseIs, details),
		newFigure("write_overhead_p99", "ms", ms(notify.P99), ms(base.P99), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p99", " with NOTIFY, the service's default", b.cfg.writeOrders), baseIs, nil),
		newFigure("write_overhead_no_notify_p50", "ms", ms(plain.P50), ms(base.P50), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p50", " without NOTIFY (OUTBOX_NOTIFY=false)", b.cfg.writeOrders), baseIs, nil),
		newFigure("write_overhead_no_notify_p99", "ms", ms(plain.P99), ms(base.P99), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p99", " without NOTIFY (OUTBOX_NOTIFY=false)", b.cfg.writeOrders), baseIs, nil),
	}, nil
}

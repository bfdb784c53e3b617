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

// beginner starts a transaction: a pool, or one of its connections.
type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// createOrder runs Store.Create's transaction for an order without an
// Idempotency-Key: the order built by the client, then one batch with its
// INSERT and, when w is not nil, its order.created event queued by w, then the
// commit. It returns the order id and the commit time.
func createOrder(ctx context.Context, db beginner, w *outbox.Writer, n int) (string, time.Time, error) {
	id := newUUID()
	customer := fmt.Sprintf("c-%d", n%1000)
	now := time.Now().UTC().Truncate(time.Microsecond)
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
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

// writeCost is what one arm of write_overhead spent, summed over its blocks:
// the CPU of the PostgreSQL backend that ran its transactions and the time it
// waited for a CPU (/proc/PID/schedstat, exact), the benchmark's own CPU (the
// client: pgx, JSON, the writer), the WAL its transactions generated, and the
// wall time of the transactions.
type writeCost struct {
	orders                  int
	backendRun, backendWait time.Duration
	client, wall            time.Duration
	walBytes                int64
}

func (c writeCost) perOrder() map[string]float64 {
	if c.orders == 0 {
		return nil
	}
	us := func(d time.Duration) float64 { return round(float64(d.Nanoseconds()) / 1e3 / float64(c.orders)) }
	return map[string]float64{
		"backend_cpu_us": us(c.backendRun), "backend_runqueue_us": us(c.backendWait),
		"client_cpu_us": us(c.client), "mean_us": us(c.wall),
		"wal_bytes": round(float64(c.walBytes) / float64(c.orders)),
	}
}

// writeMeter reads a writeCost's parts around one block of transactions.
type writeMeter struct {
	pool *pgxpool.Pool // another connection, for the WAL position
	pid  int           // the backend of the measured connection
}

type writeReading struct {
	sched schedStat
	self  time.Duration
	lsn   int64
	at    time.Time
}

func (m writeMeter) read(ctx context.Context) (writeReading, error) {
	var r writeReading
	var err error
	if r.lsn, err = walPosition(ctx, m.pool); err != nil {
		return r, err
	}
	if r.sched, err = readSchedstat("/proc", m.pid); err != nil {
		return r, fmt.Errorf("backend %d: %w", m.pid, err)
	}
	if r.self, err = selfCPU(); err != nil {
		return r, err
	}
	r.at = time.Now()
	return r, nil
}

// walPosition reads the server's WAL insert position, in bytes.
func walPosition(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var lsn int64
	if err := pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn() - '0/0'").Scan(&lsn); err != nil {
		return 0, fmt.Errorf("WAL position: %w", err)
	}
	return lsn, nil
}

func (c *writeCost) add(a, b writeReading, orders int) {
	c.orders += orders
	c.backendRun += b.sched.run - a.sched.run
	c.backendWait += b.sched.wait - a.sched.wait
	c.client += b.self - a.self
	c.wall += b.at.Sub(a.at)
	c.walBytes += b.lsn - a.lsn
}

// runWriteOverhead measures write_overhead: the latency of creating an order
// with its outbox row, against the same transaction without it. One client,
// sequential transactions on one connection; the arms alternate in small
// blocks so background noise lands on all of them alike. Around each block
// the instrument reads the connection's backend's CPU, the benchmark's own
// and the WAL written (writeCost).
func (b *bench) runWriteOverhead(ctx context.Context) ([]Figure, error) {
	_, pool, err := b.env.openDatabase(ctx, "write", b.migrateOrders)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	meter := writeMeter{pool: pool}
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&meter.pid); err != nil {
		return nil, err
	}
	measured := true
	if _, err := readSchedstat("/proc", meter.pid); err != nil {
		measured = false // the server is on another machine: latencies only
		b.log.Warn("write_overhead: the backend's CPU is not measured", "error", err)
	}
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
		cost   writeCost
	}
	withWriter := func(w *outbox.Writer) func(int) error {
		return func(n int) error {
			_, _, err := createOrder(ctx, conn, w, n)
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
			var before writeReading
			if measured && done >= 0 {
				if before, err = meter.read(ctx); err != nil {
					return nil, err
				}
			}
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
			if measured && done >= 0 {
				after, err := meter.read(ctx)
				if err != nil {
					return nil, err
				}
				arms[i].cost.add(before, after, block)
			}
		}
	}

	sums := map[string]Latencies{}
	costs := map[string]map[string]float64{}
	details := map[string]any{"orders_per_arm": b.cfg.writeOrders, "clients": 1, "block": block}
	for _, a := range arms {
		s, err := summarize(a.lat)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		sums[a.name] = s
		d := map[string]any{"p50_ms": ms(s.P50), "p90_ms": ms(s.P90), "p99_ms": ms(s.P99), "max_ms": ms(s.Max)}
		if per := a.cost.perOrder(); per != nil {
			costs[a.name] = per
			d["per_order"] = per
		}
		details[a.name] = d
	}
	base := sums["no_outbox"]
	baseIs := "the same transaction (BEGIN, one batch with the order's INSERT, COMMIT) without the event"
	measuresFmt := "%s latency of Store.Create's transaction (BEGIN, one batch with the order's INSERT and its order.created event%s, COMMIT), one client, %d orders"
	notify, plain := sums["outbox_notify"], sums["outbox"]
	figs := []Figure{
		newFigure("write_overhead_p50", "ms", ms(plain.P50), ms(base.P50), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p50", ", no NOTIFY: the service's default with its in-process relay", b.cfg.writeOrders), baseIs, details),
		newFigure("write_overhead_p99", "ms", ms(plain.P99), ms(base.P99), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p99", ", no NOTIFY: the service's default with its in-process relay", b.cfg.writeOrders), baseIs, nil),
		newFigure("write_overhead_notify_p50", "ms", ms(notify.P50), ms(base.P50), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p50", " and a NOTIFY: the service's default with RELAY=false, relays in other processes", b.cfg.writeOrders), baseIs, nil),
		newFigure("write_overhead_notify_p99", "ms", ms(notify.P99), ms(base.P99), Goal{RatioAtMost, 1.15},
			fmt.Sprintf(measuresFmt, "p99", " and a NOTIFY: the service's default with RELAY=false, relays in other processes", b.cfg.writeOrders), baseIs, nil),
	}
	if with, without := costs["outbox"], costs["no_outbox"]; with != nil && without != nil {
		figs = append(figs,
			newFigure("write_overhead_cpu_postgresql", "us/order", with["backend_cpu_us"], without["backend_cpu_us"], Goal{},
				"CPU time per order of the PostgreSQL backend running Store.Create's transaction with its event, no NOTIFY (/proc/PID/schedstat, mean over the blocks)",
				"the same without the event", nil),
			newFigure("write_overhead_cpu_client", "us/order", with["client_cpu_us"], without["client_cpu_us"], Goal{},
				"CPU time per order of the client (the benchmark's process: pgx, the payload's JSON, outbox.Writer) creating an order with its event",
				"the same without the event", nil),
			newFigure("write_overhead_wal", "bytes/order", with["wal_bytes"], without["wal_bytes"], Goal{},
				"WAL written per order created with its event (pg_current_wal_insert_lsn around each block)",
				"the same without the event", nil),
		)
	}
	return figs, nil
}

package main

import (
	"bytes"
	"context"
	"crypto/md5"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// seedReadOrdersSQL inserts orders 1 to $1 in one statement. Order i has the
// id md5(i) read as a UUID, so the client can name any of them without
// reading them back; the ids are spread over the whole key space, as random
// UUIDs are.
const seedReadOrdersSQL = `
	INSERT INTO orders (id, customer_id, currency, items, total, status, version, created_at, updated_at)
	SELECT md5(i::text)::uuid, 'c-' || (i % 1000), 'EUR',
	       '[{"sku":"sku-1","quantity":2,"unit_price":1250}]', 2500, 'created', 1, now(), now()
	FROM generate_series(1, $1::bigint) AS i`

// readOrderID is the id seedReadOrdersSQL gives order i.
func readOrderID(i int) string {
	h := md5.Sum(fmt.Appendf(nil, "%d", i))
	s := fmt.Sprintf("%x", h)
	return s[0:8] + "-" + s[8:12] + "-" + s[12:16] + "-" + s[16:20] + "-" + s[20:32]
}

// readArm is one orders service with a table of n orders.
type readArm struct {
	name string
	n    int
	addr string
	// tableMiB is the orders table's size with its indexes.
	tableMiB float64
	lat      []time.Duration
}

// runReadFlat measures read_flat: the latency of GET /orders/{id} through the
// orders service (its HTTP handler, Store.Get, PostgreSQL) with
// b.cfg.readOrders orders in the table, against the same with
// b.cfg.readBaseOrders. A read that finds the order through the primary key
// costs about the same at both sizes; one that scans the table does not.
// One client, sequential requests for random orders; the two services are
// asked in alternating blocks so background noise lands on both alike.
func (b *bench) runReadFlat(ctx context.Context) ([]Figure, error) {
	dir, err := os.MkdirTemp("", "bench-read-")
	if err != nil {
		return nil, err
	}
	b.env.onClose("read figure files "+dir, func(context.Context) error { return os.RemoveAll(dir) })
	bin, err := b.buildOrders(ctx, dir)
	if err != nil {
		return nil, err
	}
	arms := []*readArm{
		{name: "small", n: b.cfg.readBaseOrders},
		{name: "large", n: b.cfg.readOrders},
	}
	for _, a := range arms {
		if err := b.prepareReadArm(ctx, bin, dir, a); err != nil {
			return nil, fmt.Errorf("%s table (%d orders): %w", a.name, a.n, err)
		}
	}

	client := &http.Client{Timeout: 10 * time.Second}
	get := func(a *readArm) (time.Duration, error) {
		id := readOrderID(1 + rand.IntN(a.n))
		start := time.Now()
		resp, err := client.Get("http://" + a.addr + "/orders/" + id)
		if err != nil {
			return 0, err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		d := time.Since(start)
		if err != nil {
			return 0, err
		}
		if resp.StatusCode != http.StatusOK {
			return 0, fmt.Errorf("GET /orders/%s: status %d", id, resp.StatusCode)
		}
		return d, nil
	}
	const block = 50
	warmup := min(500, b.cfg.readRequests/5)
	for done := -warmup; done < b.cfg.readRequests; done += block {
		for _, a := range arms {
			for range block {
				d, err := get(a)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", a.name, err)
				}
				if done >= 0 {
					a.lat = append(a.lat, d)
				}
			}
		}
	}

	sums := map[string]Latencies{}
	details := map[string]any{"requests_per_arm": b.cfg.readRequests, "clients": 1, "block": block}
	for _, a := range arms {
		s, err := summarize(a.lat)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		sums[a.name] = s
		details[a.name] = map[string]any{"orders": a.n, "table_mib": round(a.tableMiB), "p50_ms": ms(s.P50), "p90_ms": ms(s.P90), "p99_ms": ms(s.P99), "max_ms": ms(s.Max)}
	}
	large, small := sums["large"], sums["small"]
	measuresFmt := "%s latency of GET /orders/{id} through the orders service (HTTP handler, Store.Get, PostgreSQL) with %d orders in the table, one client, random orders, %d requests"
	baseIs := fmt.Sprintf("the same with %d orders in the table", b.cfg.readBaseOrders)
	return []Figure{
		newFigure("read_flat_p50", "ms", ms(large.P50), ms(small.P50), Goal{RatioAtMost, 1.5},
			fmt.Sprintf(measuresFmt, "p50", b.cfg.readOrders, b.cfg.readRequests), baseIs, details),
		newFigure("read_flat_p99", "ms", ms(large.P99), ms(small.P99), Goal{RatioAtMost, 1.5},
			fmt.Sprintf(measuresFmt, "p99", b.cfg.readOrders, b.cfg.readRequests), baseIs, nil),
	}, nil
}

// prepareReadArm creates a's database, migrates it with `orders migrate`,
// inserts a.n orders, and starts `orders serve` on it without a relay.
func (b *bench) prepareReadArm(ctx context.Context, bin, dir string, a *readArm) error {
	cfg, err := b.env.newDatabase(ctx, "read_"+a.name)
	if err != nil {
		return err
	}
	dbURL, err := b.env.databaseURLFor(cfg.ConnConfig.Database)
	if err != nil {
		return err
	}
	addr, err := freeAddr()
	if err != nil {
		return err
	}
	a.addr = addr
	env := append(os.Environ(), "DATABASE_URL="+dbURL, "HTTP_ADDR="+addr, "RELAY=false", "OUTBOX_NOTIFY=false", "LOG_LEVEL=warn")
	migrate := exec.CommandContext(ctx, bin, "migrate")
	migrate.Env = env
	if out, err := migrate.CombinedOutput(); err != nil {
		return fmt.Errorf("orders migrate: %w: %s", err, strings.TrimSpace(string(out)))
	}

	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	start := time.Now()
	if _, err := pool.Exec(ctx, seedReadOrdersSQL, a.n); err != nil {
		return fmt.Errorf("insert %d orders: %w", a.n, err)
	}
	// Set the visibility map and the planner's statistics, as autovacuum
	// would on a table that has been there a while.
	if _, err := pool.Exec(ctx, "VACUUM (ANALYZE) orders"); err != nil {
		return fmt.Errorf("vacuum orders: %w", err)
	}
	var size int64
	if err := pool.QueryRow(ctx, "SELECT pg_total_relation_size('orders')").Scan(&size); err != nil {
		return fmt.Errorf("size of orders: %w", err)
	}
	a.tableMiB = float64(size) / (1 << 20)
	b.log.Info("orders inserted", "table", a.name, "orders", a.n, "table_mib", int(a.tableMiB), "seconds", int(time.Since(start).Seconds()))

	return b.startOrders(ctx, bin, env, addr, filepath.Join(dir, "orders-"+a.name+".log"))
}

// databaseURLFor returns the run's database URL naming database instead, for
// a child process.
func (e *env) databaseURLFor(database string) (string, error) {
	u, err := url.Parse(e.databaseURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return "", fmt.Errorf("the read figure needs BENCH_DATABASE_URL as a postgres:// URL, got %s", redact(e.databaseURL))
	}
	u.Path, u.RawPath = "/"+database, ""
	return u.String(), nil
}

// buildOrders builds the orders service into dir and returns the binary.
func (b *bench) buildOrders(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "orders")
	cmd := exec.CommandContext(ctx, goCommand(), "build", "-o", bin, "./services/orders")
	cmd.Dir = b.env.root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build ./services/orders: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return bin, nil
}

// startOrders runs `orders serve` with env, logging to logPath, and waits
// until its /readyz answers 200. The run's close stops it.
func (b *bench) startOrders(ctx context.Context, bin string, env []string, addr, logPath string) error {
	_, err := b.startProcess(ctx, "orders", exec.Command(bin, "serve"), env, addr, logPath)
	return err
}

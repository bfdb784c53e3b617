package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// runningRelay is a real relay (pkg/outbox with the RabbitMQ publisher)
// running in the benchmark's process, on a pool of its own.
type runningRelay struct {
	relay  interface{ Wake() } // *outbox.Relay, or *outboxwal.Relay (startWALRelay)
	pool   *pgxpool.Pool
	pub    *outboxamqp.Publisher
	cancel context.CancelFunc
	wg     sync.WaitGroup
	after  func() // run by stop, last
}

// startRelay connects a publisher to url and starts a relay on a new pool of
// poolCfg; tracer, when not nil, sees the relay's SQL.
func startRelay(ctx context.Context, poolCfg *pgxpool.Config, url string, cfg outbox.RelayConfig, tracer pgx.QueryTracer) (*runningRelay, error) {
	pc := poolCfg.Copy()
	if tracer != nil {
		pc.ConnConfig.Tracer = tracer
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("relay pool: %w", err)
	}
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: url, Exchange: exchange, ConnectionName: "bench-relay", Logger: cfg.Logger})
	if err != nil {
		pool.Close()
		return nil, err
	}
	relay, err := outbox.NewRelay(pool, untraced(pub), cfg)
	if err != nil {
		_ = pub.Close()
		pool.Close()
		return nil, err
	}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	if err := pub.WaitReady(wctx); err != nil {
		_ = pub.Close()
		pool.Close()
		return nil, fmt.Errorf("relay connect: %w", err)
	}
	rctx, cancel := context.WithCancel(ctx)
	r := &runningRelay{relay: relay, pool: pool, pub: pub, cancel: cancel}
	r.wg.Go(func() { _ = relay.Run(rctx) })
	return r, nil
}

// stop stops the relay (it finishes its batches in flight) and closes its
// connections.
func (r *runningRelay) stop() {
	r.cancel()
	r.wg.Wait()
	_ = r.pub.Close()
	r.pool.Close()
	if r.after != nil {
		r.after()
	}
}

// waitDrained polls until the outbox holds no pending row, or the timeout.
func waitDrained(ctx context.Context, pool *pgxpool.Pool, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var pending int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NULL").Scan(&pending); err != nil {
			return fmt.Errorf("count pending rows: %w", err)
		}
		if pending == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d rows still pending after %v", pending, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// paced calls fn(i) at rate calls per second for d, each call in its own
// goroutine (open loop: a slow call does not delay the next ones), at most
// maxInFlight at once. It returns the number of calls made and the first
// error.
func paced(ctx context.Context, perSecond int, d time.Duration, maxInFlight int, fn func(ctx context.Context, i int) error) (int, error) {
	n, _, err := pacedLoop(ctx, perSecond, d, maxInFlight, true, func(ctx context.Context, i int, _ time.Time) error { return fn(ctx, i) })
	return n, err
}

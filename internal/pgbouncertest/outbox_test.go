package pgbouncertest_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/internal/pgbouncertest"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// database creates a database of the test's own, directly, dropped when the
// test ends, and returns its name.
func database(t *testing.T) string {
	t.Helper()
	ctx := t.Context()
	admin, err := pgx.Connect(ctx, pgbouncertest.DatabaseURL())
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL unreachable at %s (required under CI=true): %v", pgbouncertest.DatabaseURL(), err)
		}
		t.Skipf("PostgreSQL unreachable at %s: %v", pgbouncertest.DatabaseURL(), err)
	}
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	name := "pgbouncer_test_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
		_ = admin.Close(ctx)
	})
	return name
}

// The helper's own contract: connections pass, Restart drops them and
// serves again on the same port, Kill stops it.
func TestBouncerRestartAndKill(t *testing.T) {
	t.Parallel()
	name := database(t)
	b := pgbouncertest.Start(t, pgbouncertest.Options{})
	ctx := t.Context()
	u := b.URL(name, url.Values{"default_query_exec_mode": {"cache_describe"}})
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var db string
	if err := conn.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil || db != name {
		t.Fatalf("through PgBouncer: database %q, %v", db, err)
	}
	b.Restart()
	if err := conn.Ping(ctx); err == nil {
		t.Fatal("a connection survived the restart")
	}
	conn2, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatalf("after restart: %v\n%s", err, b.Logs())
	}
	_ = conn2.Close(ctx)
	b.Kill()
	if c, err := pgx.Connect(ctx, u); err == nil {
		_ = c.Close(ctx)
		t.Fatal("connected after Kill")
	}
}

// failingPublisher fails the first attempt of every event whose id is a
// multiple of three, and confirms the rest.
type failingPublisher struct {
	mu        sync.Mutex
	published map[int64]int
}

func (p *failingPublisher) WaitReady(context.Context) error { return nil }

func (p *failingPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]error, len(msgs))
	for i, m := range msgs {
		if m.ID%3 == 0 && m.Attempt == 1 {
			out[i] = errors.New("refused once")
			continue
		}
		p.published[m.ID]++
	}
	return out
}

func (p *failingPublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.published)
}

// Package outbox works through a transaction-pooling PgBouncer in each query
// mode that needs no named prepared statement: Migrate, CheckSchema, Enqueue
// and Writer.Queue (batches), the relay's claim, mark (a batch with its own
// BEGIN and COMMIT) and failure records, its vacuum, and Admin, across a
// PgBouncer restart. LISTEN does not pass: the relay's probe reports the
// fallback and the poll publishes everything.
func TestOutboxBehindTransactionPooler(t *testing.T) {
	for _, mode := range []string{"cache_describe", "exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			name := database(t)
			b := pgbouncertest.Start(t, pgbouncertest.Options{PoolSize: 2})
			ctx := t.Context()
			pool, err := pgxpool.New(ctx, b.URL(name, url.Values{"default_query_exec_mode": {mode}}))
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			if err := outbox.Migrate(ctx, pool); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
			if err := outbox.CheckSchema(ctx, pool); err != nil {
				t.Fatalf("CheckSchema: %v", err)
			}
			w, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: "outbox_" + name})
			if err != nil {
				t.Fatal(err)
			}
			enqueue := func(i int) error {
				msg := outbox.Message{AggregateType: "order", AggregateID: fmt.Sprintf("o-%d", i%5), EventType: "order.created",
					Payload: []byte(fmt.Sprintf(`{"n":%d}`, i)), Headers: map[string]string{"traceparent": "00-x"}}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if i%2 == 0 {
						_, err := w.Enqueue(ctx, tx, msg)
						return err
					}
					batch := &pgx.Batch{}
					if _, err := w.Queue(batch, msg); err != nil {
						return err
					}
					return tx.SendBatch(ctx, batch).Close()
				})
				if err != nil {
					return fmt.Errorf("enqueue %d: %w", i, err)
				}
				return nil
			}

			pub := &failingPublisher{published: map[int64]int{}}
			var mu sync.Mutex
			var fallback []bool
			relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{
				PollInterval: 50 * time.Millisecond, RetryBackoffMin: 10 * time.Millisecond, RetryBackoffMax: 20 * time.Millisecond,
				NotifyChannel: "outbox_" + name, VacuumEvery: 10,
				Observer: outbox.ObserverFunc(func(_ context.Context, o outbox.Observation) {
					if o.Kind == outbox.KindListenFallback {
						mu.Lock()
						fallback = append(fallback, o.Fallback)
						mu.Unlock()
					}
				}),
			})
			if err != nil {
				t.Fatal(err)
			}
			rctx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- relay.Run(rctx) }()
			defer func() {
				stop()
				if err := <-done; err != nil {
					t.Errorf("Run: %v", err)
				}
			}()

			const n = 60
			for i := range n {
				if i == n/2 {
					b.Restart()
				}
				// A transaction cut by the restart is retried, as a client
				// would; anything else fails the test.
				for try := 1; ; try++ {
					err := enqueue(i)
					if err == nil {
						break
					}
					if i != n/2 || try == 5 {
						t.Fatal(err)
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
			waitFor(t, "every event published", time.Minute, func() bool { return pub.count() == n })
			var st outboxadmin.Status
			waitFor(t, "the outbox drained", time.Minute, func() bool {
				st, err = outboxadmin.New(pool).Status(ctx)
				return err == nil && st.Pending == 0
			})
			if _, err := outboxadmin.New(pool).DeadLetters(ctx, 0, 10); err != nil {
				t.Fatalf("DeadLetters: %v", err)
			}
			waitFor(t, "the LISTEN probe's verdict", 30*time.Second, func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(fallback) > 0
			})
			mu.Lock()
			if !fallback[0] {
				t.Errorf("LISTEN through PgBouncer reported working: %v", fallback)
			}
			mu.Unlock()
		})
	}
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

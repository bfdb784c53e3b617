// Package outboxtest holds the test helpers shared by pkg/outbox and its
// subpackages: a PostgreSQL schema of each test's own, enqueueing, waiting on
// a condition, and publishers without a broker. It lives under pkg/outbox, so copying that
// directory copies it too.
package outboxtest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// DatabaseURL is where tests find PostgreSQL: TEST_DATABASE_URL, or the local
// server.
func DatabaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
}

// Unavailable skips t because what is unreachable, or fails it under CI=true,
// where every service must be there.
func Unavailable(t testing.TB, what string, err error) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s unreachable (required under CI=true): %v", what, err)
	}
	t.Skipf("%s unreachable: %v", what, err)
}

// NewSchema creates a fresh, empty schema named prefix_<random> and returns a
// pool whose connections use it, and a function that closes the pool and
// drops the schema.
func NewSchema(ctx context.Context, prefix string) (*pgxpool.Pool, func() error, error) {
	admin, err := pgx.Connect(ctx, DatabaseURL())
	if err != nil {
		return nil, nil, fmt.Errorf("connect to %s: %w", DatabaseURL(), err)
	}
	defer admin.Close(ctx)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := prefix + "_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		return nil, nil, fmt.Errorf("create schema: %w", err)
	}
	drop := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, DatabaseURL())
		if err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		return nil
	}
	cfg, err := pgxpool.ParseConfig(DatabaseURL())
	if err != nil {
		return nil, nil, errors.Join(err, drop())
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, errors.Join(err, drop())
	}
	return pool, func() error { pool.Close(); return drop() }, nil
}

// SchemaPool returns a pool on a fresh schema without the outbox tables,
// dropped when the test ends.
func SchemaPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(ctx, DatabaseURL()); err != nil {
		Unavailable(t, "PostgreSQL at "+DatabaseURL(), err)
	} else {
		_ = conn.Close(ctx)
	}
	pool, drop, err := NewSchema(ctx, "outbox_test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := drop(); err != nil {
			t.Error(err)
		}
	})
	return pool
}

// Pool returns a pool on a fresh schema with the outbox tables migrated.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := SchemaPool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := outbox.MigrateWithConfig(ctx, pool, outbox.MigrateConfig{Logger: slog.New(slog.DiscardHandler)}); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return pool
}

// Msg is an event of the order aggregateID, with a JSON payload naming it and a
// trace header.
func Msg(aggregateID, eventType string) outbox.Message {
	return outbox.Message{
		AggregateType: "order",
		AggregateID:   aggregateID,
		EventType:     eventType,
		Payload:       []byte(fmt.Sprintf(`{"order_id":%q}`, aggregateID)),
		Headers:       map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
	}
}

// Enqueue writes msgs in a transaction of their own.
func Enqueue(t testing.TB, pool *pgxpool.Pool, msgs ...outbox.Message) []outbox.Enqueued {
	t.Helper()
	var out []outbox.Enqueued
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		var err error
		out, err = new(outbox.Writer).Enqueue(context.Background(), tx, msgs...)
		return err
	})
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	return out
}

// WaitFor polls cond until it holds, failing the test on an error or after
// timeout.
func WaitFor(t testing.TB, what string, timeout time.Duration, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// OutboxEmpty is a WaitFor condition: no row left in the outbox table.
func OutboxEmpty(pool *pgxpool.Pool) func() (bool, error) {
	return func() (bool, error) {
		var n int
		err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox").Scan(&n)
		return n == 0, err
	}
}

// StartRelay runs a relay on pool until the test ends, and fails the test if
// Run returns an error or does not return within 30s of being cancelled.
func StartRelay(t testing.TB, pool *pgxpool.Pool, pub outbox.Publisher, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	relay, err := outbox.NewRelay(pool, pub, cfg)
	if err != nil {
		t.Fatalf("NewRelay: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("relay did not stop within 30s of its context being cancelled")
		}
	})
	return relay
}

// AMQPURL is where tests find RabbitMQ: TEST_AMQP_URL, or the local broker.
func AMQPURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

// WantCrashDeadLetter fails t unless the only dead letter in pool's outbox is
// event id, with attempts attempts and a reason saying its relay stopped while
// publishing it: what either relay writes for an event that kills the relays
// that publish it.
func WantCrashDeadLetter(t testing.TB, pool *pgxpool.Pool, id int64, attempts int) {
	t.Helper()
	dls, err := outboxadmin.New(pool).DeadLetters(context.Background(), 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 || dls[0].ID != id || dls[0].Attempts != attempts ||
		!strings.Contains(dls[0].LastError, "relay stopped") {
		t.Fatalf("dead letters = %+v, want event %d with %d attempts and the reason", dls, id, attempts)
	}
}

// EveryState is an outbox holding an event in each state, all of aggregate
// type "order": ids 1..5 published (aggregates o-1..o-5), 6 dead-lettered
// (o-6, version 1), 7 discarded (o-7), 8 pending, blocked behind 6 (o-6,
// version 2).
func EveryState(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := Pool(t)
	for i := 1; i <= 7; i++ {
		Enqueue(t, pool, Msg(fmt.Sprintf("o-%d", i), "order.created"))
	}
	StartRelay(t, pool, refusing{"o-6", "o-7"}, outbox.RelayConfig{
		MaxAttempts: 1, PollInterval: 10 * time.Millisecond, Logger: slog.New(slog.DiscardHandler),
	})
	admin := outboxadmin.New(pool)
	WaitFor(t, "five published, two dead letters", 30*time.Second, func() (bool, error) {
		s, err := admin.Status(context.Background())
		return s.Pending == 0 && s.DeadLettered == 2, err
	})
	if err := admin.Discard(context.Background(), 7, "test"); err != nil {
		t.Fatal(err)
	}
	Enqueue(t, pool, Msg("o-6", "order.cancelled"))
	return pool
}

// refusing takes every message but those of the aggregates it lists.
type refusing []string

func (refusing) WaitReady(ctx context.Context) error { return ctx.Err() }

func (r refusing) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if slices.Contains(r, m.AggregateID) {
			errs[i] = errors.New("refused")
		}
	}
	return errs
}

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

// runCommand runs one orders command to its end with env and returns its output.
func runCommand(ctx context.Context, env map[string]string, args ...string) (string, error) {
	var out bytes.Buffer
	err := run(ctx, args, func(k string) string { return env[k] }, &out, &out)
	return out.String(), err
}

// migratedDatabaseURL names a database that `orders migrate` created, dropped
// when the test ends.
func migratedDatabaseURL(t *testing.T) string {
	t.Helper()
	dbURL := newDatabaseURL(t)
	if out, err := runCommand(t.Context(), map[string]string{"DATABASE_URL": dbURL}, "migrate"); err != nil {
		t.Fatalf("orders migrate: %v\n%s", err, out)
	}
	return dbURL
}

func connectPool(t *testing.T, dbURL string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func databaseName(t *testing.T, dbURL string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Database
}

// Only `orders migrate` runs DDL: with an event trigger that rejects every DDL
// statement in the database, migrate fails, and every other command works.
func TestOnlyMigrateRunsDDL(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	dbURL := migratedDatabaseURL(t)
	pool := connectPool(t, dbURL)
	ctx := t.Context()
	_, err := pool.Exec(ctx, `CREATE FUNCTION public.reject_ddl() RETURNS event_trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'DDL outside orders migrate: %', tg_tag; END $$`)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
		t.Skipf("event triggers need a superuser: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE EVENT TRIGGER reject_ddl ON ddl_command_start EXECUTE FUNCTION public.reject_ddl()`); err != nil {
		t.Fatal(err)
	}

	env := map[string]string{"DATABASE_URL": dbURL, "AMQP_URL": amqpURL}
	if out, err := runCommand(ctx, env, "migrate"); err == nil || !strings.Contains(err.Error(), "DDL outside orders migrate") {
		t.Fatalf("migrate under the trigger: %v %s, want the trigger's error (or the trigger catches nothing)", err, out)
	}
	for _, args := range [][]string{{"outbox-status"}, {"dead-letters", "list"}} {
		if out, err := runCommand(ctx, env, args...); err != nil {
			t.Errorf("orders %v: %v\n%s", args, err, out)
		}
	}

	relayAddr, apiAddr := freeAddr(t), freeAddr(t)
	relayEnv := map[string]string{"DATABASE_URL": dbURL, "AMQP_URL": amqpURL, "HTTP_ADDR": relayAddr}
	start(t, relayEnv, "relay")
	waitReady(t, "http://"+relayAddr)
	apiEnv := map[string]string{"DATABASE_URL": dbURL, "AMQP_URL": amqpURL, "HTTP_ADDR": apiAddr}
	start(t, apiEnv)
	waitReady(t, "http://"+apiAddr)
	if status, o := post(t, "http://"+apiAddr+"/orders", orderBody); status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
}

// While a business transaction that wrote to the outbox is open, the
// operator's commands answer, and other writers are not queued behind them.
func TestOperatorCommandsDoNotQueueWriters(t *testing.T) {
	t.Parallel()
	dbURL := migratedDatabaseURL(t)
	pool := connectPool(t, dbURL)
	ctx := t.Context()
	env := map[string]string{"DATABASE_URL": dbURL}

	held, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // ends the test's transaction
	if err := outbox.Enqueue(ctx, held, outbox.Message{AggregateType: "order", AggregateID: "held", EventType: "order.created", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if _, err := held.Exec(ctx, "SELECT id FROM outbox FOR UPDATE"); err != nil {
		t.Fatal(err)
	}

	for i, args := range [][]string{{"outbox-status"}, {"dead-letters", "list"}} {
		done := make(chan error, 2)
		var out string
		go func() {
			var err error
			out, err = runCommand(ctx, env, args...)
			done <- err
		}()
		go func() {
			done <- pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return outbox.Enqueue(ctx, tx, outbox.Message{AggregateType: "order", AggregateID: fmt.Sprint("other-", i), EventType: "order.created", Payload: []byte(`{}`)})
			})
		}()
		// Nothing may wait for a lock. A hang, not a slow answer, is the
		// failure: the bound only ends the test.
		deadline := time.Now().Add(30 * time.Second)
		for finished := 0; finished < 2; {
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("orders %v and a writer beside it: %v", args, err)
				}
				finished++
				continue
			case <-time.After(20 * time.Millisecond):
			}
			if waiting := lockWaiters(t, pool, databaseName(t, dbURL)); len(waiting) > 0 {
				_ = held.Rollback(ctx) // let them finish before the test ends
				t.Fatalf("orders %v: waiting for a lock while a writer's transaction is open: %q", args, waiting)
			}
			if time.Now().After(deadline) {
				t.Fatalf("orders %v and a writer beside it did not finish", args)
			}
		}
		if args[0] == "outbox-status" && !strings.HasPrefix(out, "pending=") {
			t.Errorf("outbox-status: %q", out)
		}
	}
}

// lockWaiters returns the statements of database that wait for a lock.
func lockWaiters(t *testing.T, pool *pgxpool.Pool, database string) []string {
	t.Helper()
	rows, err := pool.Query(t.Context(), `SELECT query FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'`, database)
	if err != nil {
		t.Fatal(err)
	}
	queries, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return queries
}

// Only migrate creates a database: every other command refuses a
// DATABASE_URL that names a missing one, naming it, and creates nothing (a
// typo must not read as an empty, healthy outbox).
func TestCommandsRefuseAMissingDatabase(t *testing.T) {
	t.Parallel()
	dbURL := newDatabaseURL(t)
	name := databaseName(t, dbURL)
	admin := pgtest.Connect(t)
	env := map[string]string{
		"DATABASE_URL": dbURL, "HTTP_ADDR": freeAddr(t),
		"AMQP_URL": "amqp://guest:guest@127.0.0.1:1/", // never reached
	}
	for _, args := range [][]string{{"outbox-status"}, {"dead-letters", "list"}, {"relay"}, {"serve"}} {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		out, err := runCommand(ctx, env, args...)
		cancel()
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("database %q does not exist", name)) || !strings.Contains(err.Error(), "orders migrate") {
			t.Errorf("orders %v: %v %q, want an error naming database %s and orders migrate", args, err, out, name)
		}
		var exists bool
		if err := admin.QueryRow(t.Context(), "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
			t.Fatal(err)
		}
		if exists {
			t.Fatalf("orders %v created database %s", args, name)
		}
	}
}

// A database without the schema, or with an older one, is an error that says
// to run migrate; nothing is created. A schema too new for the binary is an
// error too, and migrate leaves it alone.
func TestCommandsRefuseAMissingOrOutdatedSchema(t *testing.T) {
	t.Parallel()
	dbURL := newDatabaseURL(t)
	admin := pgtest.Connect(t)
	if _, err := admin.Exec(t.Context(), "CREATE DATABASE "+databaseName(t, dbURL)); err != nil {
		t.Fatal(err)
	}
	pool := connectPool(t, dbURL)
	env := map[string]string{
		"DATABASE_URL": dbURL, "HTTP_ADDR": freeAddr(t),
		"AMQP_URL": "amqp://guest:guest@127.0.0.1:1/", // never reached
	}
	commands := [][]string{{"outbox-status"}, {"dead-letters", "list"}, {"relay"}, {"serve"}}
	check := func(state string, want string, commands [][]string) {
		t.Helper()
		for _, args := range commands {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			out, err := runCommand(ctx, env, args...)
			cancel()
			if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "orders migrate") {
				t.Errorf("%s: orders %v: %v %q, want an error saying %q and to run orders migrate", state, args, err, out, want)
			}
		}
	}

	check("empty database", "schema missing", commands)
	var tables int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").Scan(&tables); err != nil || tables != 0 {
		t.Fatalf("the commands created %d tables (%v)", tables, err)
	}

	if out, err := runCommand(t.Context(), env, "migrate"); err != nil {
		t.Fatalf("migrate: %v %s", err, out)
	}
	if _, err := pool.Exec(t.Context(), "COMMENT ON TABLE outbox IS NULL"); err != nil {
		t.Fatal(err)
	}
	check("outbox schema without a version", "schema outdated", commands)

	// A schema migrated by a later binary that refuses this one: every
	// command refuses, migrate included, and none says to migrate.
	const tooNew = "pkg/outbox schema 1000; binaries of schema 1000 or later"
	if _, err := pool.Exec(t.Context(), "COMMENT ON TABLE outbox IS '"+tooNew+"'"); err != nil {
		t.Fatal(err)
	}
	for _, args := range append(commands, []string{"migrate"}) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		out, err := runCommand(ctx, env, args...)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "too new") || strings.Contains(err.Error(), "run `orders migrate`") {
			t.Errorf("schema too new: orders %v: %v %q, want an error saying the schema is too new", args, err, out)
		}
	}
	var marker string
	if err := pool.QueryRow(t.Context(), "SELECT obj_description('outbox'::regclass, 'pg_class')").Scan(&marker); err != nil || marker != tooNew {
		t.Fatalf("the marker is %q after the commands (%v), want %q untouched", marker, err, tooNew)
	}
	if _, err := pool.Exec(t.Context(), "COMMENT ON TABLE outbox IS NULL"); err != nil {
		t.Fatal(err)
	}

	if out, err := runCommand(t.Context(), env, "migrate"); err != nil {
		t.Fatalf("migrate: %v %s", err, out)
	}
	if _, err := pool.Exec(t.Context(), "DROP TABLE order_amendments, idempotency_keys, orders"); err != nil {
		t.Fatal(err)
	}
	check("no orders table", `table "orders"`, [][]string{{"serve"}})
}

// outbox-status says when its pending count is PostgreSQL's estimate (a
// backlog above outboxadmin.StatusCountLimit) rather than a count.
func TestOutboxStatusSaysWhenPendingIsAnEstimate(t *testing.T) {
	t.Parallel()
	dbURL := migratedDatabaseURL(t)
	pool := connectPool(t, dbURL)
	ctx := t.Context()
	env := map[string]string{"DATABASE_URL": dbURL}
	if out, err := runCommand(ctx, env, "outbox-status"); err != nil || !strings.Contains(out, "pending=0 ") || !strings.Contains(out, "pending_estimated=false") {
		t.Fatalf("outbox-status: %v %q, want pending=0 and pending_estimated=false", err, out)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT 'order', 'o-' || g, 1, 'order.created', '{}' FROM generate_series(1, $1::int) g`, outboxadmin.StatusCountLimit+1); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("pending=%d ", outboxadmin.StatusCountLimit+1)
	if out, err := runCommand(ctx, env, "outbox-status"); err != nil || !strings.Contains(out, want) || !strings.Contains(out, "pending_estimated=true") {
		t.Fatalf("outbox-status: %v %q, want %q and pending_estimated=true", err, out, want)
	}
}

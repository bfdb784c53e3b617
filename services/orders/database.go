package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
)

// Only `orders migrate` (and `orders serve` with MIGRATE=true) creates the
// database and runs the schemas' DDL. Every other command opens the database
// as it is and checks, from the catalog alone, that the schema it uses is
// there: DDL at start, even CREATE INDEX IF NOT EXISTS with nothing to create,
// takes a SHARE lock on outbox, so it waits for any open business transaction
// that wrote to the outbox, and every writer then queues behind it.

// migrate creates the database of DATABASE_URL if it does not exist and
// applies the orders and outbox schemas.
func migrate(ctx context.Context, getenv func(string) string, stdout io.Writer) error {
	cfg, err := config.FromEnv(getenv)
	if err != nil {
		return err
	}
	pcfg, err := postgres.PoolConfig(cfg.DatabaseURL, cfg.DatabasePooler)
	if err != nil {
		return err
	}
	pool, err := postgres.Open(ctx, pcfg)
	if err != nil {
		return err
	}
	pool.Close()
	fmt.Fprintln(stdout, "orders: database and schema are up to date")
	return nil
}

// serveDatabase opens the database for `orders serve`: it must exist and hold
// both schemas, unless MIGRATE=true, which creates and migrates it first.
func serveDatabase(ctx context.Context, cfg config.Config, tp trace.TracerProvider) (*pgxpool.Pool, error) {
	if cfg.Migrate {
		pcfg, err := postgres.PoolConfig(cfg.DatabaseURL, cfg.DatabasePooler)
		if err != nil {
			return nil, err
		}
		pool, err := postgres.Open(ctx, pcfg)
		if err != nil {
			return nil, err
		}
		pool.Close()
	}
	return connect(ctx, cfg, true, tp)
}

// openDatabase opens the database of DATABASE_URL for the operator's commands:
// it must exist and hold the outbox schema.
func openDatabase(ctx context.Context, getenv func(string) string) (*pgxpool.Pool, error) {
	cfg, err := config.FromEnv(getenv)
	if err != nil {
		return nil, err
	}
	return connect(ctx, cfg, false, nil)
}

// connect opens DATABASE_URL's database without creating or changing
// anything, and checks its outbox schema, and with ordersTables the orders
// service's tables too. A missing database, or a schema that is missing or
// outdated, is an error that names the database and says to run `orders
// migrate`. With TRACE_DB=true, every statement gets a span from tp (nil:
// none).
func connect(ctx context.Context, c config.Config, ordersTables bool, tp trace.TracerProvider) (*pgxpool.Pool, error) {
	cfg, err := postgres.PoolConfig(c.DatabaseURL, c.DatabasePooler)
	if err != nil {
		return nil, err
	}
	if tp != nil && c.Tracing.DatabaseSpans {
		cfg.ConnConfig.Tracer = databaseTracer(tp)
	}
	name := cfg.ConnConfig.Database
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to database %q: %w", name, err)
	}
	if err := checkDatabase(ctx, pool, name, ordersTables); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

func checkDatabase(ctx context.Context, pool *pgxpool.Pool, name string, ordersTables bool) error {
	const hint = "run `orders migrate` first"
	err := pool.Ping(ctx)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "3D000" { // invalid_catalog_name
		return fmt.Errorf("database %q does not exist (DATABASE_URL): %s: %w", name, hint, err)
	}
	if err != nil {
		return fmt.Errorf("connect to database %q: %w", name, err)
	}
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		return fmt.Errorf("database %q: %w; %s", name, err, hint)
	}
	if !ordersTables {
		return nil
	}
	for _, table := range []string{"orders", "idempotency_keys"} {
		var found bool
		if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&found); err != nil {
			return fmt.Errorf("database %q: check table %q: %w", name, table, err)
		}
		if !found {
			return fmt.Errorf("database %q: table %q is missing; %s", name, table, hint)
		}
	}
	return nil
}

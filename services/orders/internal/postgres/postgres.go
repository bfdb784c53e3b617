package postgres

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

//go:embed schema.sql
var schema string

const migrateLockKey int64 = 0x6f7264657273 // "orders"

// Open connects to cfg's database (see PoolConfig), creating it first when it
// does not exist (so the service runs with zero setup against a fresh server),
// and applies the orders and outbox schemas, logging the outbox migration's
// steps and waits to log.
func Open(ctx context.Context, cfg *pgxpool.Config, log *slog.Logger) (*pgxpool.Pool, error) {
	if err := ensureDatabase(ctx, cfg.ConnConfig); err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	if err := Migrate(ctx, pool, log); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// Migrate applies the orders schema and the outbox schema (see
// outbox.MigrateWithConfig, which logs to log). It is idempotent and safe to
// run from several processes at once.
func Migrate(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLockKey); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, schema)
		return err
	})
	if err != nil {
		return fmt.Errorf("migrate orders schema: %w", err)
	}
	if err := outbox.MigrateWithConfig(ctx, pool, outbox.MigrateConfig{Logger: log}); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return nil
}

// ensureDatabase creates cfg's database when connecting to it fails because it
// does not exist.
func ensureDatabase(ctx context.Context, cfg *pgx.ConnConfig) error {
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err == nil {
		return conn.Close(ctx)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "3D000" { // invalid_catalog_name
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	admin := cfg.Copy()
	admin.Database = "postgres"
	aconn, err := pgx.ConnectConfig(ctx, admin)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL to create database %q: %w", cfg.Database, err)
	}
	defer aconn.Close(ctx)
	_, err = aconn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{cfg.Database}.Sanitize())
	if errors.As(err, &pgErr) && pgErr.Code == "42P04" { // duplicate_database: another process won
		return nil
	}
	if err != nil {
		return fmt.Errorf("create database %q: %w", cfg.Database, err)
	}
	return nil
}

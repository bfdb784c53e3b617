package outbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// exampleDB returns a pool on a fresh, empty schema of the test database and a
// function that drops it, so examples run in isolation like tests. Examples
// cannot skip: they need the database.
func exampleDB() (*pgxpool.Pool, func()) {
	ctx := context.Background()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "outbox_example_" + hex.EncodeToString(b)
	admin, err := pgx.Connect(ctx, testDatabaseURL())
	if err != nil {
		panic(fmt.Sprintf("examples need PostgreSQL at %s: %v", testDatabaseURL(), err))
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		panic(err)
	}
	cfg, err := pgxpool.ParseConfig(testDatabaseURL())
	if err != nil {
		panic(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		panic(err)
	}
	return pool, func() {
		pool.Close()
		c, err := pgx.Connect(ctx, testDatabaseURL())
		if err != nil {
			panic(err)
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			panic(err)
		}
	}
}

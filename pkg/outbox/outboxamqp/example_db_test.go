package outboxamqp_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// exampleDB returns a pool on a fresh, empty schema of the test database and a
// function that drops it. Examples cannot skip: they need the database.
func exampleDB() (*pgxpool.Pool, func()) {
	pool, drop, err := outboxtest.NewSchema(context.Background(), "outboxamqp_example")
	if err != nil {
		panic(fmt.Sprintf("examples need PostgreSQL at %s: %v", outboxtest.DatabaseURL(), err))
	}
	return pool, func() {
		if err := drop(); err != nil {
			panic(err)
		}
	}
}

package outboxadmin_test

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The helpers of package outbox's tests. Each test works in a schema of its
// own, dropped in cleanup, so tests run in parallel.
var (
	newSchemaPool = outboxtest.SchemaPool // fresh schema, no outbox tables
	newTestPool   = outboxtest.Pool       // fresh schema, outbox tables migrated
	msg           = outboxtest.Msg
	enqueue       = outboxtest.Enqueue
	waitFor       = outboxtest.WaitFor
	outboxEmpty   = outboxtest.OutboxEmpty
	startRelay    = outboxtest.StartRelay
)

// memPublisher confirms every message its fail function lets through and
// keeps it; fastConfig retries quickly.
type memPublisher = outboxtest.MemPublisher

var fastConfig = outboxtest.FastConfig

// sameJSON compares JSON documents: jsonb normalises spacing and key order.
func sameJSON(a, b []byte) bool {
	var x, y any
	return json.Unmarshal(a, &x) == nil && json.Unmarshal(b, &y) == nil && reflect.DeepEqual(x, y)
}

type planNode struct {
	NodeType     string     `json:"Node Type"`
	RelationName string     `json:"Relation Name"`
	ActualRows   float64    `json:"Actual Rows"`
	Plans        []planNode `json:"Plans"`
}

// exampleDB returns a pool on a fresh, empty schema of the test database and a
// function that drops it, so examples run in isolation like tests. Examples
// cannot skip: they need the database.
func exampleDB() (*pgxpool.Pool, func()) {
	pool, drop, err := outboxtest.NewSchema(context.Background(), "outboxadmin_example")
	if err != nil {
		panic(fmt.Sprintf("examples need PostgreSQL at %s: %v", outboxtest.DatabaseURL(), err))
	}
	return pool, func() {
		if err := drop(); err != nil {
			panic(err)
		}
	}
}

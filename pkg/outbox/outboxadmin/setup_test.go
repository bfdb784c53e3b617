package outboxadmin_test

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox"
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

// memPublisher confirms every message fail lets through and keeps it.
type memPublisher struct {
	mu        sync.Mutex
	published []outbox.Envelope
	fail      func(outbox.Envelope) error
	// block, when set, is called at the start of each PublishBatch.
	block func(ctx context.Context)
}

func (p *memPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p *memPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	p.mu.Lock()
	block, fail := p.block, p.fail
	p.mu.Unlock()
	if block != nil {
		block(ctx)
	}
	errs := make([]error, len(msgs))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, m := range msgs {
		if fail != nil {
			if errs[i] = fail(m); errs[i] != nil {
				continue
			}
		}
		p.published = append(p.published, m)
	}
	return errs
}

func (p *memPublisher) setFail(f func(outbox.Envelope) error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail = f
}

func (p *memPublisher) snapshot() []outbox.Envelope {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.published)
}

// fastConfig is a relay configuration that retries quickly, for tests.
func fastConfig(t testing.TB) outbox.RelayConfig {
	return outbox.RelayConfig{
		BatchSize:       100,
		PollInterval:    50 * time.Millisecond,
		Lease:           10 * time.Second,
		PublishTimeout:  5 * time.Second,
		RetryBackoffMin: 10 * time.Millisecond,
		RetryBackoffMax: 50 * time.Millisecond,
		Logger:          outboxtest.Logger(t),
	}
}

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

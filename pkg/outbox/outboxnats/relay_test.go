package outboxnats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// enqueueAggregates writes events events of each of aggs aggregates, one
// transaction per round, the aggregates interleaved.
func enqueueAggregates(t *testing.T, pool *pgxpool.Pool, aggs, events int) []outbox.Enqueued {
	t.Helper()
	var out []outbox.Enqueued
	for v := range events {
		msgs := make([]outbox.Message, aggs)
		for a := range aggs {
			msgs[a] = outboxtest.Msg(fmt.Sprintf("o-%d", a), []string{"order.created", "order.amended"}[min(v, 1)])
		}
		out = append(out, outboxtest.Enqueue(t, pool, msgs...)...)
	}
	return out
}

// The polling relay publishes a PostgreSQL outbox to JetStream through the
// Publisher: every event once, each aggregate's in version order, and
// every row marked.
func TestPollingRelayPublishesToJetStream(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	js := jetStream(t, srv.ClientURL())
	prefix := randomName("orders")
	stream := newStream(t, js, jetstream.StreamConfig{Subjects: []string{prefix + ".>"}})
	pool := outboxtest.Pool(t)
	enqueued := enqueueAggregates(t, pool, 20, 15)

	pub := newPublisher(t, srv.ClientURL(), prefix)
	outboxtest.StartRelay(t, pool, pub, outbox.RelayConfig{
		BatchSize:       50,
		Workers:         3,
		PollInterval:    50 * time.Millisecond,
		RetryBackoffMin: 10 * time.Millisecond,
		RetryBackoffMax: 100 * time.Millisecond,
		Logger:          testLogger(t),
	})
	outboxtest.WaitFor(t, "the outbox drained", 60*time.Second, outboxtest.OutboxEmpty(pool))
	wantPerAggregateOrder(t, stream.waitMessages(t, len(enqueued), 10*time.Second), enqueued)
}

// The WAL relay does the same from a replication slot.
func TestWALRelayPublishesToJetStream(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	js := jetStream(t, srv.ClientURL())
	prefix := randomName("orders")
	stream := newStream(t, js, jetstream.StreamConfig{Subjects: []string{prefix + ".>"}})
	pool := outboxtest.Pool(t)
	cfg := walConfig(t, pool)
	enqueued := enqueueAggregates(t, pool, 5, 10) // before the slot: handed to polling

	pub := newPublisher(t, srv.ClientURL(), prefix)
	relay, err := outboxwal.NewRelay(pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	runCtx, stop := context.WithCancel(context.Background())
	go func() { done <- relay.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("the WAL relay did not stop within 30s")
		}
	})
	outboxtest.WaitFor(t, "the relay streaming", 30*time.Second, func() (bool, error) { return relay.Stats().Active, nil })
	enqueued = append(enqueued, enqueueAggregates(t, pool, 20, 15)...) // streamed from the slot
	outboxtest.WaitFor(t, "the outbox drained", 60*time.Second, outboxtest.OutboxEmpty(pool))
	wantPerAggregateOrder(t, stream.waitMessages(t, len(enqueued), 10*time.Second), enqueued)
}

// walConfig is a WAL relay configuration with a slot and a publication of
// the test's own, dropped when the test ends (after the relay stopped:
// register the relay after calling it). The slot's name starts as
// outboxwal's tests name theirs, whose TestMain drops those an interrupted
// run left behind.
func walConfig(t *testing.T, pool *pgxpool.Pool) outboxwal.Config {
	t.Helper()
	var level string
	if err := pool.QueryRow(t.Context(), "SHOW wal_level").Scan(&level); err != nil {
		t.Fatal(err)
	}
	if level != "logical" {
		outboxtest.Unavailable(t, "PostgreSQL with wal_level=logical", fmt.Errorf("wal_level=%s", level))
	}
	name := fmt.Sprintf("outboxwal_test_%d_%s", time.Now().Unix(), randomName("nats"))
	t.Cleanup(func() {
		outboxtest.WaitFor(t, "the slot dropped", 30*time.Second, func() (bool, error) {
			// The walsender of the stopped relay may still be exiting.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return outboxwal.Drop(ctx, pool, name, name) == nil, nil
		})
	})
	return outboxwal.Config{
		Slot:             name,
		Publication:      name,
		BatchSize:        50,
		PublishTimeout:   5 * time.Second,
		StatusInterval:   100 * time.Millisecond,
		SweepInterval:    20 * time.Millisecond,
		TakeoverInterval: 100 * time.Millisecond,
		Poll: outbox.RelayConfig{
			PollInterval:    50 * time.Millisecond,
			RetryBackoffMin: 10 * time.Millisecond,
			RetryBackoffMax: 50 * time.Millisecond,
		},
		Logger: testLogger(t),
	}
}

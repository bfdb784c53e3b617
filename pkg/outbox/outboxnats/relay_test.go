package outboxnats_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest/waltest"
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
	waltest.RequireLogical(t, pool)
	cfg := waltest.Config(t, pool)
	cfg.BatchSize = 50
	enqueued := enqueueAggregates(t, pool, 5, 10) // before the slot: handed to polling

	pub := newPublisher(t, srv.ClientURL(), prefix)
	relay, _ := waltest.Start(t, pool, pub, cfg)
	waltest.WaitActive(t, relay)
	enqueued = append(enqueued, enqueueAggregates(t, pool, 20, 15)...) // streamed from the slot
	outboxtest.WaitFor(t, "the outbox drained", 60*time.Second, outboxtest.OutboxEmpty(pool))
	wantPerAggregateOrder(t, stream.waitMessages(t, len(enqueued), 10*time.Second), enqueued)
}

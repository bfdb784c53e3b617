package outboxwal_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// An aggregate whose head event fails must not hold up the others, nor the
// slot. Retried inside the relay, the head kept its aggregate's later events
// in memory; once they filled MaxInMemory the relay stopped reading the
// stream: no other aggregate's event went out, and the slot kept the
// server's WAL, for as long as the head's backoff lasted (about an hour with
// the defaults). The failing aggregate goes to polling instead, which
// retries its head and dead-letters it after its attempts.
func TestAFailingAggregateLeavesTheStream(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "order.created") // "order.refused" is returned: unroutable
	cfg := walConfig(t, pool)
	cfg.MaxInMemory, cfg.BatchSize = 20, 10
	cfg.Poll.RetryBackoffMin, cfg.Poll.RetryBackoffMax = time.Second, 5*time.Minute // the defaults
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	var refused []outbox.Enqueued
	for range 25 {
		refused = append(refused, enqueue(t, pool, msg("hot", "order.refused"))...)
	}
	other := enqueue(t, pool, msg("other", "order.created"))
	waitFor(t, "the other aggregate's event", 15*time.Second, func() (bool, error) {
		return receivedIDs(b.Deliveries())[other[0].ID] > 0, nil
	})
	waitFor(t, "the slot acknowledged past the failing aggregate", 15*time.Second, slotCaughtUp(t, pool, cfg.Slot))

	// Polling has the failing aggregate: its head is retried, the rest
	// wait behind it in order.
	waitFor(t, "the head retried by polling", 15*time.Second, func() (bool, error) {
		var attempts int
		err := pool.QueryRow(ctx, `SELECT attempts FROM outbox WHERE id = $1`, refused[0].ID).Scan(&attempts)
		return attempts >= 2, err
	})
	if n := count(t, pool, `SELECT count(*) FROM outbox WHERE aggregate_id = 'hot'`); n != len(refused) {
		t.Fatalf("%d rows of the failing aggregate in the outbox, want %d", n, len(refused))
	}
	if s := relay.Stats(); s.InMemory != 0 {
		t.Fatalf("the relay still holds %d events", s.InMemory)
	}
}

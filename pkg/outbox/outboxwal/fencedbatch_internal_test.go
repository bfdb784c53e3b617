package outboxwal

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// slotsPool is a migrated schema of the test's own with outbox_wal_slots,
// and the name of its server.
func slotsPool(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	pool := outboxtest.Pool(t)
	if err := ensureSlotsTable(ctx, pool); err != nil {
		t.Fatal(err)
	}
	var server string
	if err := pool.QueryRow(ctx, "SELECT "+serverSQL).Scan(&server); err != nil {
		t.Fatal(err)
	}
	return pool, server
}

// countingPublisher confirms everything and counts what it was given.
type countingPublisher struct{ sent atomic.Int64 }

func (p *countingPublisher) WaitReady(context.Context) error { return nil }

func (p *countingPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	p.sent.Add(int64(len(msgs)))
	return make([]error, len(msgs))
}

// A session whose epoch is no longer the slot's sends nothing: the
// statement that records a batch's dispatched position is conditional on
// the epoch, and it is the only statement before an event's first attempt.
// (Retries and suspect events also go through the fenced attempt record,
// which is why a test that only retries cannot tell.)
func TestFencedSessionStartsNoBatch(t *testing.T) {
	ctx := context.Background()
	pool, server := slotsPool(t)
	const slot = "fenced_batch"
	old, err := takeSlot(ctx, pool, slot, server)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := takeSlot(ctx, pool, slot, server); err != nil { // another session takes it
		t.Fatal(err)
	}
	pub := &countingPublisher{}
	r, err := NewRelay(pool, pub, Config{Slot: slot, Publication: slot})
	if err != nil {
		t.Fatal(err)
	}
	s := newState(r.cfg, fence{slot: slot, epoch: old.epoch, server: server}, 0)
	tx := s.begin(time.Now(), 1, 100)
	s.add(tx, outbox.Envelope{ID: 1, AggregateType: "order", AggregateID: "a", AggregateVersion: 1, EventType: "order.created"}, false)
	s.seal(tx, 120)
	batch := s.take(10)
	if len(batch) != 1 {
		t.Fatalf("took %d events, want 1", len(batch))
	}
	if err := r.publish(ctx, s, batch); !errors.Is(err, errFenced) {
		t.Fatalf("publish from a fenced session: %v, want errFenced", err)
	}
	if n := pub.sent.Load(); n != 0 {
		t.Fatalf("a fenced session sent %d messages", n)
	}
}

package outboxwal_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// refusingPublisher refuses every message and records the attempt numbers it
// was given.
type refusingPublisher struct {
	mu       sync.Mutex
	attempts []int
}

func (p *refusingPublisher) WaitReady(context.Context) error { return nil }

func (p *refusingPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		p.attempts = append(p.attempts, m.Attempt)
		errs[i] = errors.New("refused by the test")
	}
	return errs
}

func (p *refusingPublisher) snapshot() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int(nil), p.attempts...)
}

// A relay that has acknowledged nothing yet, because the first transaction
// of its stream holds an event still being retried, must still answer the
// server: a WAL sender that hears nothing for wal_sender_timeout ends the
// connection, and every reconnect would start the event's attempts from
// zero again, so it would never be dead-lettered and the slot never move.
func TestRepliesToTheServerBeforeTheFirstAcknowledgement(t *testing.T) {
	ctx := context.Background()
	base := walPool(t)
	pc := base.Config().Copy()
	pc.ConnConfig.RuntimeParams["wal_sender_timeout"] = "2s"
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cfg := walConfig(t, base)
	cfg.MaxAttempts = 1_000_000
	pub := &refusingPublisher{}
	prep, err := outboxwal.New(pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := prep.Prepare(ctx); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, msg("stuck", "order.created"))

	relay, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)
	waitFor(t, "a few attempts", 30*time.Second, func() (bool, error) { return len(pub.snapshot()) >= 3, nil })
	pid := func() int32 {
		var p *int32
		if err := base.QueryRow(ctx, "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1", cfg.Slot).Scan(&p); err != nil {
			t.Fatal(err)
		}
		if p == nil {
			return 0
		}
		return *p
	}
	first := pid()
	// Several times wal_sender_timeout: the WAL sender would have ended a
	// silent connection by now (at most one timeout after the last reply).
	time.Sleep(8 * time.Second)
	if now := pid(); now != first {
		t.Fatalf("the WAL sender changed from pid %d to %d: the server ended the relay's replication connection", first, now)
	}
	got := pub.snapshot()
	for i := 1; i < len(got); i++ {
		if got[i] < got[i-1] {
			t.Fatalf("attempt numbers went back from %d to %d (a new session forgot the failures): %v", got[i-1], got[i], got)
		}
	}
}

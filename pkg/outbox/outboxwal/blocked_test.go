package outboxwal_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// gatePublisher confirms the events of allowed ids and answers ErrNotSent
// (no attempt counted) for the others.
type gatePublisher struct {
	mu      sync.Mutex
	allowed map[int64]bool
	sent    []int64
}

func (p *gatePublisher) WaitReady(context.Context) error { return nil }

func (p *gatePublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if p.allowed != nil && !p.allowed[m.ID] {
			errs[i] = outbox.ErrNotSent
			continue
		}
		p.sent = append(p.sent, m.ID)
	}
	return errs
}

func (p *gatePublisher) has(id int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range p.sent {
		if s == id {
			return true
		}
	}
	return false
}

// An event written behind an unpublished one is inserted "blocked", and the
// polling relay claims only unblocked rows. When the WAL relay sweeps the
// earlier event, the next one must be unblocked as the polling relay's mark
// does: otherwise, once that row goes to polling (going back to the polling
// relay as the package documents it, or a new slot handing the outbox over),
// it is never claimed.
func TestSweepUnblocksTheNextEvent(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	gate := &gatePublisher{allowed: map[int64]bool{}}
	prep, err := outboxwal.NewRelay(pool, gate, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := prep.Prepare(ctx); err != nil {
		t.Fatal(err)
	}
	first := enqueue(t, pool, msg("a", "order.created"))
	second := enqueue(t, pool, msg("a", "order.paid"))
	gate.mu.Lock()
	gate.allowed[first[0].ID] = true
	gate.mu.Unlock()

	relay, stop := startWAL(t, pool, gate, cfg)
	waitActive(t, relay)
	waitFor(t, "the first event swept", 30*time.Second, func() (bool, error) {
		return count(t, pool, "SELECT count(*) FROM outbox WHERE id = $1", first[0].ID) == 0, nil
	})
	stop()
	waitSlotFree(t, pool, cfg.Slot)
	if err := outboxwal.Drop(ctx, pool, cfg.Slot, cfg.Publication); err != nil {
		t.Fatal(err)
	}

	// Back to polling.
	poll := &gatePublisher{}
	poller, err := outbox.NewRelay(pool, poll, outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- poller.Run(pctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "the polling relay publishing the second event", 30*time.Second, func() (bool, error) {
		return poll.has(second[0].ID), nil
	})
}

// A row left blocked behind nothing (by a sweep that did not unblock, or a
// row deleted by hand) is unblocked when the slot is made and the outbox
// handed over to polling: otherwise it would never be published.
func TestHandOverAtSlotCreationUnblocksRowsBehindNothing(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	first := enqueue(t, pool, msg("a", "order.created"))
	second := enqueue(t, pool, msg("a", "order.paid"))
	if _, err := pool.Exec(ctx, "DELETE FROM outbox WHERE id = $1", first[0].ID); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, "SELECT count(*) FROM outbox WHERE id = $1 AND blocked", second[0].ID); n != 1 {
		t.Fatalf("the second event is not blocked (%d): the test does not set up what it means to", n)
	}
	cfg := walConfig(t, pool)
	pub := &gatePublisher{}
	relay, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)
	waitFor(t, "the second event published", 30*time.Second, func() (bool, error) { return pub.has(second[0].ID), nil })
}

package outboxwal_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// blockingPublisher holds every batch until release is closed (or the
// publish times out), then answers that nothing was sent: the batch stays
// unconfirmed for as long as the test wants.
type blockingPublisher struct {
	release chan struct{}
	once    sync.Once
	taken   atomic.Int64 // messages handed to PublishBatch

	mu      sync.Mutex
	holding map[int64]int // ids of the messages in a PublishBatch call now
}

func newBlockingPublisher() *blockingPublisher {
	return &blockingPublisher{release: make(chan struct{}), holding: map[int64]int{}}
}

func (p *blockingPublisher) WaitReady(context.Context) error { return nil }

func (p *blockingPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	p.taken.Add(int64(len(msgs)))
	p.hold(msgs, 1)
	defer p.hold(msgs, -1)
	select {
	case <-p.release:
	case <-ctx.Done():
	}
	errs := make([]error, len(msgs))
	for i := range errs {
		errs[i] = outbox.ErrNotSent
	}
	return errs
}

func (p *blockingPublisher) hold(msgs []outbox.Envelope, d int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		if p.holding[m.ID] += d; p.holding[m.ID] == 0 {
			delete(p.holding, m.ID)
		}
	}
}

// inFlight says whether the message with id is in a PublishBatch call now.
func (p *blockingPublisher) inFlight(id int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.holding[id] > 0
}

func (p *blockingPublisher) unblock() { p.once.Do(func() { close(p.release) }) }

func currentLSN(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	var lsn string
	if err := pool.QueryRow(context.Background(), "SELECT pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	return lsn
}

// The slot is never acknowledged past an event the broker has not confirmed:
// a restart resumes from the acknowledged position, so acknowledging a
// decoded transaction before its events are confirmed would lose them. Here
// event a is in flight (its publish does not return until the test lets it)
// and b waits behind it; the relay reports its position for a while; the
// slot's confirmed position must still be before a's transaction, and a
// relay started afterwards publishes both.
//
// The waits are long and say nothing of speed: under load the WAL sender
// may take minutes to decode the other tests' bulk writes before it reaches
// b. a's publish outlasts them all (PublishTimeout), so the state waited for
// is one the relay stays in, not a window that a retry of a closes.
func TestSlotIsNotAcknowledgedPastAnUnconfirmedEvent(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	cfg.PublishTimeout = time.Hour
	var acks atomic.Int64
	cfg.Observer = outboxtest.OnAcknowledged(cfg.Observer, func(uint64) { acks.Add(1) })
	blocking := newBlockingPublisher()
	relay, stop := startWAL(t, pool, blocking, cfg)
	t.Cleanup(blocking.unblock) // before stop, which waits for the batch in flight
	waitActive(t, relay)

	a := enqueue(t, pool, msg("a", "order.created"))
	afterA := currentLSN(t, pool)
	waitFor(t, "the first event in flight", longWait, func() (bool, error) { return blocking.inFlight(a[0].ID), nil })
	later := enqueue(t, pool, msg("a", "order.cancelled"))
	waitFor(t, "the second event decoded", longWait, func() (bool, error) { return relay.Stats().InMemory == 2, nil })
	if !blocking.inFlight(a[0].ID) || blocking.inFlight(later[0].ID) {
		t.Fatalf("want event %d in flight and event %d waiting behind it", a[0].ID, later[0].ID)
	}
	from := acks.Load()
	waitFor(t, "the relay reporting its position", longWait, func() (bool, error) { return acks.Load() >= from+5, nil })

	var ahead bool
	if err := pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`,
		cfg.Slot, afterA).Scan(&ahead); err != nil {
		t.Fatal(err)
	}
	if ahead {
		t.Fatalf("the slot was acknowledged past event %d (at or after %s) while the broker had not confirmed it", a[0].ID, afterA)
	}

	blocking.unblock()
	stop()
	next, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, next)
	got := b.waitIDs("both events after the restart", append(a, later...))
	checkAggregateOrder(t, got)
}

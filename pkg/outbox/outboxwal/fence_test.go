package outboxwal_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// holdingPublisher holds its first batch until release is closed, then
// refuses it; it records the id of every message it is given.
type holdingPublisher struct {
	held    chan struct{} // closed once the first batch arrived
	release chan struct{}
	once    sync.Once

	mu   sync.Mutex
	sent []int64
}

func newHoldingPublisher() *holdingPublisher {
	return &holdingPublisher{held: make(chan struct{}), release: make(chan struct{})}
}

func (p *holdingPublisher) WaitReady(context.Context) error { return nil }

func (p *holdingPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	p.mu.Lock()
	for _, m := range msgs {
		p.sent = append(p.sent, m.ID)
	}
	p.mu.Unlock()
	first := false
	p.once.Do(func() { first = true; close(p.held) })
	if first {
		<-p.release
	}
	errs := make([]error, len(msgs))
	for i := range errs {
		errs[i] = errors.New("refused by the test")
	}
	return errs
}

func (p *holdingPublisher) given() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int64(nil), p.sent...)
}

// cutOffConfig is a relay that, once its replication connection is cut, does
// not notice for a long while: its stream is paused (MaxInMemory reached by
// one event in flight and one waiting for the only worker) and it reports
// its position only every 10s. So is a relay whose host lost the network but
// whose process runs on.
func cutOffConfig(cfg outboxwal.Config) outboxwal.Config {
	cfg.Workers, cfg.BatchSize, cfg.MaxInMemory = 1, 1, 2
	cfg.StatusInterval = 10 * time.Second
	return cfg
}

// cutReplication terminates the WAL sender of the relay streaming from slot,
// and leaves its process running.
func cutReplication(t *testing.T, pool *pgxpool.Pool, slot string) {
	t.Helper()
	if n := count(t, pool, `SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots WHERE slot_name = $1 AND active`, slot); n != 1 {
		t.Fatalf("terminated %d WAL senders, want 1", n)
	}
}

// publishThroughHolder lets gate, the publisher of the relay that holds the
// slot, send the event id, and waits for it to be published and swept.
func publishThroughHolder(t *testing.T, pool *pgxpool.Pool, gate *gatePublisher, ids ...int64) {
	t.Helper()
	gate.mu.Lock()
	for _, id := range ids {
		gate.allowed[id] = true
	}
	gate.mu.Unlock()
	for _, id := range ids {
		waitFor(t, "the event published by the relay holding the slot", 10*time.Second, func() (bool, error) {
			return gate.has(id), nil
		})
	}
	waitFor(t, "the outbox empty", 10*time.Second, outboxEmpty(pool))
}

// A relay whose replication connection was cut while its process runs on
// must not go on beside the relay that took the slot over. Here one event
// is in flight when the connection is cut, and another waits for the
// worker; after the takeover the first attempt fails. The cut-off relay
// must start no batch (the second event is never handed to its publisher:
// every batch starts with a statement that proves the session still holds
// the slot) and write nothing (it would hand the first event over to
// polling while the relay holding the slot publishes it: every write starts
// with the same check, under a lock the takeover waits for). It stops.
func TestCutOffRelayStartsNothingAndWritesNothingAfterTakeover(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	holding := newHoldingPublisher()
	first, _ := startWAL(t, pool, holding, cutOffConfig(cfg))
	waitActive(t, first)
	a := enqueue(t, pool, msg("a", "order.created"))
	b := enqueue(t, pool, msg("b", "order.created"))
	select {
	case <-holding.held:
	case <-time.After(10 * time.Second):
		t.Fatal("the first relay did not publish")
	}
	waitFor(t, "the first relay holding both events", 10*time.Second, func() (bool, error) {
		return first.Stats().InMemory == 2, nil
	})

	cutReplication(t, pool, cfg.Slot)
	gate := &gatePublisher{allowed: map[int64]bool{}}
	second, _ := startWAL(t, pool, gate, cfg)
	waitActive(t, second)
	close(holding.release) // the attempt in flight fails now
	waitFor(t, "the cut-off relay stopping", 10*time.Second, func() (bool, error) { return !first.Stats().Active, nil })
	time.Sleep(5 * cfg.SweepInterval)
	if got := holding.given(); len(got) != 1 {
		t.Fatalf("the cut-off relay's publisher was given %v, want only the event in flight at the takeover", got)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox WHERE handed_over OR dead_lettered_at IS NOT NULL`); n != 0 {
		t.Fatalf("the cut-off relay dead-lettered or handed over %d rows after the other relay took the slot", n)
	}

	publishThroughHolder(t, pool, gate, a[0].ID, b[0].ID)
	dls, err := outboxadmin.New(pool).DeadLetters(ctx, 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 0 {
		t.Fatalf("dead letters: %+v", dls)
	}
}

// Each session that takes the slot bumps its epoch and names itself; Drop
// forgets the slot's row with the slot.
func TestSessionsTakeTheSlotInTurnAndDropForgetsIt(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	for want := 1; want <= 2; want++ {
		r, stop := startWAL(t, pool, &gatePublisher{}, cfg)
		waitActive(t, r)
		var (
			epoch  int
			holder string
		)
		if err := pool.QueryRow(ctx, `SELECT epoch, holder FROM outbox_wal_slots WHERE slot_name = $1`, cfg.Slot).Scan(&epoch, &holder); err != nil {
			t.Fatal(err)
		}
		if epoch != want || !strings.Contains(holder, "pid") {
			t.Fatalf("session %d: epoch %d, holder %q", want, epoch, holder)
		}
		stop()
	}
	waitSlotFree(t, pool, cfg.Slot)
	if err := outboxwal.Drop(ctx, pool, cfg.Slot, cfg.Publication); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox_wal_slots WHERE slot_name = $1`, cfg.Slot); n != 0 {
		t.Fatalf("%d rows left for the dropped slot", n)
	}
}

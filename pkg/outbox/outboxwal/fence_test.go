package outboxwal_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// holdingPublisher refuses every message; the attempt number holdAt (if
// any) is held in PublishBatch until release is closed, then refused too.
type holdingPublisher struct {
	refusingPublisher
	holdAt  int
	held    chan struct{} // closed once the held attempt arrived
	release chan struct{}
	once    sync.Once
}

func newHoldingPublisher(holdAt int) *holdingPublisher {
	return &holdingPublisher{holdAt: holdAt, held: make(chan struct{}), release: make(chan struct{})}
}

func (p *holdingPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	for _, m := range msgs {
		if p.holdAt > 0 && m.Attempt == p.holdAt {
			p.once.Do(func() { close(p.held) })
			<-p.release
		}
	}
	return p.refusingPublisher.PublishBatch(ctx, msgs)
}

// cutOffConfig is a relay that, once its replication connection is cut, does
// not notice for a long while: its stream is paused (MaxInMemory reached by
// one event being retried) and it reports its position only every 10s. So
// is a relay whose host lost the network but whose process runs on.
func cutOffConfig(cfg outboxwal.Config, maxAttempts int) outboxwal.Config {
	cfg.Workers, cfg.BatchSize, cfg.MaxInMemory = 1, 1, 1
	cfg.StatusInterval = 10 * time.Second
	cfg.MaxAttempts = maxAttempts
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
func publishThroughHolder(t *testing.T, pool *pgxpool.Pool, gate *gatePublisher, id int64) {
	t.Helper()
	gate.mu.Lock()
	gate.allowed[id] = true
	gate.mu.Unlock()
	waitFor(t, "the event published by the relay holding the slot", 10*time.Second, func() (bool, error) {
		return gate.has(id), nil
	})
	waitFor(t, "the outbox empty", 10*time.Second, outboxEmpty(pool))
}

// A relay whose replication connection was cut while its process runs on
// must not go on publishing beside the relay that took the slot over: every
// batch starts with a statement that proves the session still holds the
// slot, so it starts none once the other took it, and stops.
func TestCutOffRelayStartsNoBatchAfterTakeover(t *testing.T) {
	pool := walPool(t)
	cfg := walConfig(t, pool)
	refusing := &refusingPublisher{}
	first, _ := startWAL(t, pool, refusing, cutOffConfig(cfg, 1000))
	waitActive(t, first)
	a := enqueue(t, pool, msg("a", "order.created"))
	waitFor(t, "the first relay retrying the event", 10*time.Second, func() (bool, error) {
		return len(refusing.snapshot()) >= 2, nil
	})

	cutReplication(t, pool, cfg.Slot)
	gate := &gatePublisher{allowed: map[int64]bool{}}
	second, _ := startWAL(t, pool, gate, cfg)
	waitActive(t, second)
	atTakeover := len(refusing.snapshot())
	waitFor(t, "the cut-off relay stopping", 5*time.Second, func() (bool, error) { return !first.Stats().Active, nil })
	time.Sleep(500 * time.Millisecond) // it retried every 10 to 50ms before
	if n := len(refusing.snapshot()) - atTakeover; n > 1 {
		t.Fatalf("the cut-off relay made %d attempts after the other relay took the slot, want at most the one in flight", n)
	}

	publishThroughHolder(t, pool, gate, a[0].ID)
}

// Nor may it write to the outbox after the takeover: here its attempt in
// flight when the connection was cut fails, its last, and it would
// dead-letter the event that the relay holding the slot is publishing. The
// write starts with the same check, under a lock the takeover waits for.
func TestCutOffRelayWritesNothingAfterTakeover(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	holding := newHoldingPublisher(2)
	first, _ := startWAL(t, pool, holding, cutOffConfig(cfg, 2))
	waitActive(t, first)
	a := enqueue(t, pool, msg("a", "order.created"))
	select {
	case <-holding.held:
	case <-time.After(10 * time.Second):
		t.Fatal("the first relay did not make its second attempt")
	}

	cutReplication(t, pool, cfg.Slot)
	gate := &gatePublisher{allowed: map[int64]bool{}}
	second, _ := startWAL(t, pool, gate, cfg)
	waitActive(t, second)
	close(holding.release) // the last attempt fails now
	waitFor(t, "the cut-off relay stopping", 5*time.Second, func() (bool, error) { return !first.Stats().Active, nil })
	time.Sleep(5 * cfg.SweepInterval)
	if n := count(t, pool, `SELECT count(*) FROM outbox WHERE last_error IS NOT NULL OR dead_lettered_at IS NOT NULL`); n != 0 {
		t.Fatalf("the cut-off relay dead-lettered or handed over %d rows after the other relay took the slot", n)
	}

	publishThroughHolder(t, pool, gate, a[0].ID)
	dls, err := outbox.NewAdmin(pool).DeadLetters(ctx, 0, 10)
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

package outboxwal_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// A relay that has acknowledged nothing yet, because the first transaction
// of its stream holds an event still in flight (a broker that takes its time
// to confirm), must still answer the server: a WAL sender that hears nothing
// for wal_sender_timeout ends the connection, and every reconnect would
// start over from the slot's position.
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
	pub := newBlockingPublisher()
	t.Cleanup(pub.unblock)
	prep, err := outboxwal.NewRelay(pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := prep.Prepare(ctx); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, msg("stuck", "order.created"))

	relay, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)
	waitFor(t, "the event in flight", 30*time.Second, func() (bool, error) { return pub.taken.Load() >= 1, nil })
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
}

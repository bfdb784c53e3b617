package outboxwal_test

import (
	"context"
	"testing"
	"time"
)

// With no outbox event to publish, the writes of other tables still pass
// through the slot's stream position: the relay must acknowledge past them,
// or the slot retains their WAL for as long as the outbox stays quiet.
func TestQuietOutboxLetsTheSlotAdvance(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	if _, err := pool.Exec(ctx, "CREATE TABLE quiet_other (id bigserial PRIMARY KEY, v text)"); err != nil {
		t.Fatal(err)
	}
	for range 50 {
		if _, err := pool.Exec(ctx, "INSERT INTO quiet_other (v) SELECT repeat('x', 200) FROM generate_series(1, 100)"); err != nil {
			t.Fatal(err)
		}
	}
	// wal_sender_timeout is 60s by default: the relay must not need the
	// walsender's timeout-driven keepalive to move on.
	waitFor(t, "the slot acknowledged past other tables' writes", 20*time.Second, slotCaughtUp(t, pool, cfg.Slot))
	if n := count(t, pool, "SELECT count(*) FROM outbox"); n != 0 {
		t.Fatalf("outbox has %d rows, want none", n)
	}
}

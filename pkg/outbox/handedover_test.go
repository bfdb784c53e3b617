package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// A hand-over relay publishes the rows handed over to polling, in order per
// aggregate, and leaves the others alone: they belong to the relay that reads
// the write-ahead log, even those with an error written.
func TestHandOverRelayClaimsOnlyRowsHandedOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestPool(t)
	fresh := enqueue(t, pool, msg("fresh", "order.created"))
	handed := enqueue(t, pool, msg("handed", "order.created"), msg("handed", "order.paid"))
	for _, q := range []string{
		"UPDATE outbox SET handed_over = true WHERE aggregate_id = 'handed'",
		"UPDATE outbox SET last_error = 'failed, not handed over' WHERE aggregate_id = 'fresh'",
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	pub := &memPublisher{}
	relay, err := outbox.NewRelay(pool, outboxtest.HandOver(pub), outbox.RelayConfig{PollInterval: 20 * time.Millisecond, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- relay.Run(rctx) }()
	defer func() {
		cancel()
		if err := <-stopped; err != nil {
			t.Error(err)
		}
	}()
	waitFor(t, "both handed-over rows published", 20*time.Second, func() (bool, error) {
		return len(pub.Snapshot()) == 2, nil
	})
	got := pub.Snapshot()
	if got[0].ID != handed[0].ID || got[1].ID != handed[1].ID {
		t.Fatalf("published %d then %d, want %d then %d", got[0].ID, got[1].ID, handed[0].ID, handed[1].ID)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE id = $1", fresh[0].ID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("the row not handed over left the outbox")
	}
	for _, e := range pub.Snapshot() {
		if e.ID == fresh[0].ID {
			t.Fatalf("the row not handed over was published")
		}
	}
}

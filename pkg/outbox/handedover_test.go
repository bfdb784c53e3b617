package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// A relay with HandedOverOnly publishes the rows whose last_error is set, in
// order per aggregate, and leaves the others alone: they belong to the relay
// that reads the write-ahead log.
func TestRelayHandedOverOnlyClaimsRowsWithAnError(t *testing.T) {
	t.Parallel()
	if !strings.Contains(outbox.ClaimHandedOverSQL, "o.last_error IS NOT NULL") {
		t.Fatalf("the handed-over claim does not filter on last_error:\n%s", outbox.ClaimHandedOverSQL)
	}
	ctx := context.Background()
	pool := newTestPool(t)
	fresh := enqueue(t, pool, msg("fresh", "order.created"))
	handed := enqueue(t, pool, msg("handed", "order.created"), msg("handed", "order.paid"))
	if _, err := pool.Exec(ctx, "UPDATE outbox SET last_error = 'handed over' WHERE aggregate_id = 'handed'"); err != nil {
		t.Fatal(err)
	}
	pub := &memPublisher{}
	done := make(chan outbox.BatchResult, 16)
	startRelay(t, pool, pub, outbox.RelayConfig{
		PollInterval:   20 * time.Millisecond,
		HandedOverOnly: true,
		Logger:         testLogger(t),
		Hooks:          outbox.Hooks{BatchDone: func(r outbox.BatchResult) { done <- r }},
	})
	waitFor(t, "both handed-over rows published", 20*time.Second, func() (bool, error) {
		return len(pub.snapshot()) == 2, nil
	})
	got := pub.snapshot()
	if got[0].ID != handed[0].ID || got[1].ID != handed[1].ID {
		t.Fatalf("published %d then %d, want %d then %d", got[0].ID, got[1].ID, handed[0].ID, handed[1].ID)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE id = $1", fresh[0].ID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("the row without last_error left the outbox")
	}
	for _, e := range pub.snapshot() {
		if e.ID == fresh[0].ID {
			t.Fatalf("the row without last_error was published")
		}
	}
}

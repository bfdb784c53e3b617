package outbox_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// A row the broker confirmed but the relay could not mark (here: the writer
// of the aggregate's next event kept it locked past the mark's retries) is
// published again after its lease. It is not a failure: even at its last
// attempt it must not be dead-lettered, which would hold its aggregate back
// for an operator although the event went out.
func TestUnmarkedRowAtItsLastAttemptIsNotDeadLettered(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	first := enqueue(t, pool, msg("o-1", "order.created"))[0]

	// The writer of version 2 locks version 1 until it commits.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	second, err := new(outbox.Writer).Enqueue(ctx, tx, msg("o-1", "order.paid"))
	if err != nil {
		t.Fatal(err)
	}

	results := make(chan outboxtest.BatchResult, 100)
	cfg := fastConfig(t)
	cfg.MaxAttempts = 1
	cfg.Lease = 600 * time.Millisecond
	cfg.PublishTimeout = 100 * time.Millisecond
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		select {
		case results <- r:
		default:
		}
	})
	startRelay(t, pool, &memPublisher{}, cfg)

	deadline := time.After(10 * time.Second)
	for unmarked := false; !unmarked; {
		select {
		case r := <-results:
			unmarked = slices.Contains(r.Unmarked, first.ID)
		case <-deadline:
			t.Fatal("the first event was not left unmarked")
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	var published []int64
	for len(published) < 2 {
		select {
		case r := <-results:
			if len(r.DeadLetteredAtClaim) > 0 || len(r.DeadLettered) > 0 {
				t.Fatalf("dead-lettered %v at claim, %v after publishing: event %d was confirmed, only its mark failed",
					r.DeadLetteredAtClaim, r.DeadLettered, first.ID)
			}
			for _, id := range r.Published {
				if !slices.Contains(published, id) {
					published = append(published, id)
				}
			}
		case <-deadline:
			t.Fatalf("published %v within 10s, want %d then %d", published, first.ID, second[0].ID)
		}
	}
	if want := []int64{first.ID, second[0].ID}; !slices.Equal(published, want) {
		t.Fatalf("marked %v, want %v", published, want)
	}
}

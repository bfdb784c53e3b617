package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// A hot aggregate: writers of one aggregate follow each other back to back, so
// one of them holds (or waits for) the aggregate at every moment. The relay must
// still mark each event it published and move on to the next one while they
// write: publish at least half of the events while the writers still write,
// never give up marking (which publishes the event again after every lease and
// holds back the rest), never deliver an event more than twice, and leave
// nothing behind once the writers stop.
func TestRelayKeepsUpWithBackToBackWritersOfOneAggregate(t *testing.T) {
	if testing.Short() {
		t.Skip("20 s of writing")
	}
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	pub := &memPublisher{}
	cfg := fastConfig(t)
	cfg.Lease = 4 * time.Second
	cfg.PublishTimeout = 2 * time.Second
	var unmarked, batches, claimed atomic.Int64
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		unmarked.Add(int64(len(r.Unmarked)))
		if r.Claimed > 0 {
			batches.Add(1)
			claimed.Add(int64(r.Claimed))
		}
	})
	relayPool, err := pgxpool.NewWithConfig(ctx, pool.Config())
	if err != nil {
		t.Fatal(err)
	}
	defer relayPool.Close()
	relay := startRelay(t, relayPool, pub, cfg)

	const writers = 8
	const writeFor = 20 * time.Second
	var written atomic.Int64
	stop := time.Now().Add(writeFor)
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for range writers {
		wg.Go(func() {
			for time.Now().Before(stop) {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if err := outbox.Enqueue(ctx, tx, msg("hot", "account.changed")); err != nil {
						return err
					}
					// A short transaction: a few milliseconds of work after the
					// event, before the commit.
					_, err := tx.Exec(ctx, "SELECT pg_sleep(0.005)")
					return err
				})
				if err != nil {
					errs <- err
					return
				}
				written.Add(1)
				relay.Wake()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("writer: %v", err)
	}
	duringWrites := map[int64]bool{}
	for _, e := range pub.Snapshot() {
		duringWrites[e.ID] = true
	}
	t.Logf("%d events written in %v, %d published meanwhile, in %d batches of %d events in all", written.Load(), writeFor, len(duringWrites), batches.Load(), claimed.Load())
	if n := unmarked.Load(); n > 0 {
		t.Fatalf("the relay gave up marking %d published events while the writers wrote", n)
	}
	// The relay keeps pace with the writers, in this run's own terms: at
	// least half of what they wrote went out while they were writing.
	if 2*int64(len(duringWrites)) < written.Load() {
		t.Fatalf("%d of %d events published while the writers wrote, want at least half", len(duringWrites), written.Load())
	}

	// How fast the rest drains depends on the machine; what must hold is that
	// it does, without a lease having to end.
	waitFor(t, "backlog drained", time.Minute, outboxEmpty(pool))

	got := pub.Snapshot()
	last := checkOrder(t, got, true)
	if last["hot"] != written.Load() {
		t.Fatalf("published up to version %d, want %d", last["hot"], written.Load())
	}
	deliveries := map[int64]int{}
	for _, e := range got {
		deliveries[e.ID]++
		if deliveries[e.ID] > 2 {
			t.Fatalf("event %d (version %d) delivered %d times", e.ID, e.AggregateVersion, deliveries[e.ID])
		}
	}
	if n := unmarked.Load(); n > 0 {
		t.Fatalf("the relay gave up marking %d published events", n)
	}
}

// The claim hands out an event only with every earlier event of its
// aggregate still in the outbox, in the same claim (a run behind the head),
// even for rows that say they are not blocked: rows inserted without
// Enqueue, and rows Enqueue writes unblocked (see the isolation test below).
// A head that is not due (leased, or backing off) keeps its later events out.
func TestClaimTakesAnEventOnlyWithTheEarlierOnesOfItsAggregate(t *testing.T) {
	t.Parallel()
	type claimed struct {
		agg     string
		version int64
	}
	for _, tc := range []struct {
		name    string
		headDue string
		// headLease is the head's leased_until
		headLease string
		// handOver claims as the hand-over relay does, the rows of o-1
		// handed over but its version 2
		handOver bool
		want     []claimed
	}{
		{"head due", "now()", "'-infinity'", false, []claimed{{"o-1", 1}, {"o-1", 2}, {"o-2", 1}}},
		{"head lease ended", "now()", "now() - interval '1 second'", false, []claimed{{"o-1", 1}, {"o-1", 2}, {"o-2", 1}}},
		{"head leased", "now()", "now() + interval '1 minute'", false, []claimed{{"o-2", 1}}},
		{"head backing off", "now() + interval '1 minute'", "'-infinity'", false, []claimed{{"o-2", 1}}},
		{"hand-over relay", "now()", "'-infinity'", true, []claimed{{"o-1", 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool := newTestPool(t)
			ctx := context.Background()
			_, err := pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, next_attempt_at, leased_until)
VALUES ('order', 'o-1', 2, 'order.cancelled', '{}', now(), '-infinity'), ('order', 'o-1', 1, 'order.created', '{}', `+tc.headDue+`, `+tc.headLease+`),
       ('order', 'o-2', 1, 'order.created', '{}', now(), '-infinity')`)
			if err != nil {
				t.Fatal(err)
			}
			query := outbox.ClaimSQL
			if tc.handOver {
				query = outbox.ClaimHandedOverSQL
				if _, err := pool.Exec(ctx, `UPDATE outbox SET handed_over = true WHERE aggregate_id = 'o-1' AND aggregate_version = 1`); err != nil {
					t.Fatal(err)
				}
			}
			rows, err := pool.Query(ctx, query, claimArgs(10, time.Minute)...)
			if err != nil {
				t.Fatal(err)
			}
			got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (claimed, error) {
				v, err := r.Values()
				if err != nil {
					return claimed{}, err
				}
				return claimed{v[2].(string), v[3].(int64)}, nil
			})
			if err != nil {
				t.Fatal(err)
			}
			slices.SortFunc(got, func(a, b claimed) int {
				if a.agg != b.agg {
					if a.agg < b.agg {
						return -1
					}
					return 1
				}
				return int(a.version - b.version)
			})
			if !slices.Equal(got, tc.want) {
				t.Fatalf("claimed %v, want %v", got, tc.want)
			}
		})
	}
}

// Writers may run at any isolation level. At REPEATABLE READ and SERIALIZABLE
// a writer's snapshot can predate the relay's publishing of the aggregate's
// previous event; Enqueue must still work, and the new event must be
// published, after the previous one.
func TestEnqueueAtEveryIsolationLevelWhileTheRelayAdvancesTheAggregate(t *testing.T) {
	t.Parallel()
	for _, level := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(level), func(t *testing.T) {
			t.Parallel()
			pool := newTestPool(t)
			ctx := context.Background()

			// A head event the relay cannot publish yet, and a second one behind it.
			first := enqueue(t, pool, msg("o-1", "order.created"), msg("o-1", "order.paid"))
			release := make(chan struct{})
			pub := &memPublisher{}
			pub.SetFail(func(e outbox.Envelope) error {
				select {
				case <-release:
					return nil
				default:
					return errors.New("not yet")
				}
			})
			batches := make(chan outboxtest.BatchResult, 100)
			cfg := fastConfig(t)
			cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
			relay := startRelay(t, pool, pub, cfg)

			// The writer's snapshot is taken while both events are pending.
			tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: level})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			var pending int
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&pending); err != nil {
				t.Fatal(err)
			}
			if pending != 2 {
				t.Fatalf("writer sees %d pending rows, want 2", pending)
			}

			// Now the relay publishes both, advancing the aggregate.
			close(release)
			relay.Wake()
			waitPublished(t, batches, first[0].ID, first[1].ID)

			third, err := new(outbox.Writer).Enqueue(ctx, tx, msg("o-1", "order.shipped"))
			if err != nil {
				t.Fatalf("Enqueue at %s after the relay advanced the aggregate: %v", level, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("commit at %s: %v", level, err)
			}
			relay.Wake()
			waitPublished(t, batches, third[0].ID)
			checkOrder(t, pub.Snapshot(), false)
		})
	}
}

// At REPEATABLE READ, events enqueued behind a head that is still pending are
// published after it, in order.
func TestRepeatableReadWritersKeepTheOrderBehindAPendingHead(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	enqueue(t, pool, msg("o-1", "order.created"))

	var fails atomic.Int32
	pub := &memPublisher{}
	pub.SetFail(func(e outbox.Envelope) error {
		if e.AggregateVersion == 1 && fails.Add(1) <= 3 {
			return errors.New("not yet")
		}
		return nil
	})
	startRelay(t, pool, pub, fastConfig(t))
	for i := range 5 {
		err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, msg("o-1", fmt.Sprintf("order.step%d", i)))
		})
		if err != nil {
			t.Fatalf("enqueue %d: %v", i, err)
		}
	}
	waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))
	// The first attempt of the head took the events behind it along (a
	// run); they were sent, not marked, and went again after it.
	if last := checkOrder(t, pub.Snapshot(), true); last["o-1"] != 6 {
		t.Fatalf("a consumer checking versions applied up to version %d, want 6", last["o-1"])
	}
	var marked []int64
	rows, err := pool.Query(ctx, "SELECT aggregate_version FROM outbox_published ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	if marked, err = pgx.CollectRows(rows, pgx.RowTo[int64]); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(marked, []int64{1, 2, 3, 4, 5, 6}) {
		t.Fatalf("marked versions %v, want 1 to 6", marked)
	}
}

// waitPublished waits until every id in ids was published and marked.
func waitPublished(t *testing.T, batches <-chan outboxtest.BatchResult, ids ...int64) {
	t.Helper()
	want := map[int64]bool{}
	for _, id := range ids {
		want[id] = true
	}
	timeout := time.After(15 * time.Second)
	for len(want) > 0 {
		select {
		case r := <-batches:
			for _, id := range r.Published {
				delete(want, id)
			}
		case <-timeout:
			t.Fatalf("events %v not published", want)
		}
	}
}

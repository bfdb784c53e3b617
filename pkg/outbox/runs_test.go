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

// hotEvents writes n events of one aggregate in one transaction, as n
// updates made while no relay ran leave them: each behind the one before.
func hotEvents(t *testing.T, pool *pgxpool.Pool, aggregateID string, n int) []outbox.Enqueued {
	t.Helper()
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = msg(aggregateID, fmt.Sprintf("order.step%d", i+1))
	}
	return enqueue(t, pool, msgs...)
}

// batchLog keeps the relay's batch results.
type batchLog struct {
	mu  sync.Mutex
	all []outboxtest.BatchResult
}

func (l *batchLog) observer(next outbox.Observer) outbox.Observer {
	return outboxtest.OnBatch(next, func(r outboxtest.BatchResult) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.all = append(l.all, r)
	})
}

func (l *batchLog) snapshot() []outboxtest.BatchResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.all)
}

// The events of one aggregate go out as runs: a claim takes the head and,
// in the room its batch has left, the events behind it, in version order,
// and the relay publishes them in one batch. A backlog of one aggregate
// drains in batches, not one event per claim, publish, confirm and mark.
func TestRelayPublishesTheBacklogOfOneAggregateInRuns(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	hot := hotEvents(t, pool, "hot", 250)

	pub := &memPublisher{}
	var batches batchLog
	cfg := fastConfig(t) // batches of 100
	cfg.Observer = batches.observer(cfg.Observer)
	startRelay(t, pool, pub, cfg)
	waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))

	if last := checkOrder(t, pub.Snapshot(), false); last["hot"] != int64(len(hot)) {
		t.Fatalf("published up to version %d, want %d", last["hot"], len(hot))
	}
	var claims []int
	for _, b := range batches.snapshot() {
		if b.Claimed > 0 {
			claims = append(claims, b.Claimed)
		}
	}
	if len(claims) > 3 {
		t.Fatalf("%d batches of %v events for a backlog of %d events of one aggregate in batches of %d, want 3", len(claims), claims, len(hot), cfg.BatchSize)
	}
}

// The room a batch leaves after its heads is shared among them, so the
// aggregates with a backlog all advance, and a run never outgrows the batch.
func TestRunsShareTheRoomOfTheBatch(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	hotEvents(t, pool, "a", 30)
	hotEvents(t, pool, "b", 30)
	enqueue(t, pool, msg("c", "order.created"))

	rows, err := pool.Query(ctx, outbox.ClaimSQL, claimArgs(10, time.Minute)...)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]int64{}
	n := 0
	for rows.Next() {
		v, err := rows.Values()
		if err != nil {
			t.Fatal(err)
		}
		got[v[2].(string)] = append(got[v[2].(string)], v[3].(int64))
		n++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, vs := range got {
		slices.Sort(vs)
	}
	// 3 heads, 7 places left: 3 each behind a and b, none behind c.
	want := map[string][]int64{"a": {1, 2, 3, 4}, "b": {1, 2, 3, 4}, "c": {1}}
	if n != 9 || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("claimed %v (%d rows), want %v", got, n, want)
	}
}

// When an event of a run fails, the events after it are not marked, whatever
// the broker said of them: marking them would put them before it. They go
// out again after it, their attempt given back, and the failed event is
// retried alone (a failure in its past keeps the run from forming behind it).
func TestARunStopsAtItsFirstFailure(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	hot := hotEvents(t, pool, "hot", 10)

	var failed atomic.Bool
	pub := &memPublisher{}
	pub.SetFail(func(e outbox.Envelope) error {
		if e.AggregateVersion == 4 && failed.CompareAndSwap(false, true) {
			return errors.New("nacked")
		}
		return nil
	})
	var batches batchLog
	cfg := fastConfig(t)
	cfg.Observer = batches.observer(cfg.Observer)
	startRelay(t, pool, pub, cfg)
	waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))

	first := batches.snapshot()[0]
	idsOf := func(es []outbox.Enqueued) []int64 {
		var out []int64
		for _, e := range es {
			out = append(out, e.ID)
		}
		return out
	}
	if !slices.Equal(first.Published, idsOf(hot[:3])) || !slices.Equal(first.Failed, idsOf(hot[3:4])) ||
		!slices.Equal(first.Behind, idsOf(hot[4:])) {
		t.Fatalf("first batch published %v, failed %v, behind %v; want %v, %v, %v",
			first.Published, first.Failed, first.Behind, idsOf(hot[:3]), idsOf(hot[3:4]), idsOf(hot[4:]))
	}
	if last := checkOrder(t, pub.Snapshot(), true); last["hot"] != 10 {
		t.Fatalf("a consumer checking versions applied up to version %d, want 10", last["hot"])
	}
	rows, err := pool.Query(ctx, "SELECT aggregate_version, attempts FROM outbox_published ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	type marked struct{ Version, Attempts int64 }
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[marked])
	if err != nil {
		t.Fatal(err)
	}
	for i, m := range got {
		wantAttempts := int64(1)
		if m.Version == 4 {
			wantAttempts = 2
		}
		if m.Version != int64(i+1) || m.Attempts != wantAttempts {
			t.Fatalf("outbox_published holds %v, want versions 1 to 10 with 1 attempt each, 2 for version 4", got)
		}
	}
	if len(got) != 10 {
		t.Fatalf("outbox_published holds %v, want versions 1 to 10", got)
	}
}

// The crash rules hold for each event of a run: the events of a run whose
// relay stopped go back into a run, each marked suspect; a suspect head then
// goes alone, without a run; and an event that used its attempts in flight
// ends a run (the claim dead-letters it once it is the head).
func TestTheCrashRulesApplyToEachEventOfARun(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	hot := hotEvents(t, pool, "hot", 5)

	claimNow := func(alone bool) []int64 {
		t.Helper()
		args := claimArgs(100, time.Millisecond)
		args[4] = alone
		rows, err := pool.Query(ctx, outbox.ClaimSQL, args...)
		if err != nil {
			t.Fatal(err)
		}
		var versions []int64
		for rows.Next() {
			v, err := rows.Values()
			if err != nil {
				t.Fatal(err)
			}
			if v[9].(string) == "claimed" {
				versions = append(versions, v[3].(int64))
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		slices.Sort(versions)
		time.Sleep(5 * time.Millisecond) // the 1 ms lease ends: as after a crash
		return versions
	}
	suspects := func() []int64 {
		t.Helper()
		rows, err := pool.Query(ctx, "SELECT aggregate_version FROM outbox WHERE suspect ORDER BY 1")
		if err != nil {
			t.Fatal(err)
		}
		vs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return vs
	}

	if got := claimNow(false); !slices.Equal(got, []int64{1, 2, 3, 4, 5}) {
		t.Fatalf("first claim took versions %v, want the run 1 to 5", got)
	}
	// Version 4 used its attempts in flight: the run stops before it.
	if _, err := pool.Exec(ctx, "UPDATE outbox SET attempts = $1 WHERE id = $2", outbox.DefaultMaxAttempts, hot[3].ID); err != nil {
		t.Fatal(err)
	}
	if got := claimNow(false); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("claim after a stop took versions %v, want 1 to 3 (4 spent)", got)
	}
	if got := suspects(); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("suspect versions %v after their second claim, want 1 to 3", got)
	}
	// The head, in flight at two stops in a row, goes alone.
	if got := claimNow(false); got != nil {
		t.Fatalf("a claim that may not take a suspect row alone took %v", got)
	}
	if got := claimNow(true); !slices.Equal(got, []int64{1}) {
		t.Fatalf("the claim took %v, want the suspect head alone", got)
	}
}

// holdingPublisher confirms everything; on its first batch it first has
// hold run (another transaction's lock on a row of the batch, as a
// concurrent claim takes for an instant).
type holdingPublisher struct {
	memPublisher
	once sync.Once
	hold func()
}

func (p *holdingPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	p.once.Do(p.hold)
	return p.memPublisher.PublishBatch(ctx, msgs)
}

// A run is marked in version order even when a row of it cannot be locked
// at the mark: the rows after it wait for it. Were they moved first, the
// event written behind the run's last row would stay blocked behind
// nothing once the held row moved, and never be published (the relay's
// periodic release of such rows is off here, as it runs only every minute).
func TestARunIsMarkedInOrderWhenOneOfItsRowsIsHeld(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	hot := hotEvents(t, pool, "hot", 5)

	released := make(chan struct{})
	pub := &holdingPublisher{}
	pub.hold = func() {
		// The aggregate's next event commits behind the run's last row.
		enqueue(t, pool, msg("hot", "order.step6"))
		locked := make(chan struct{})
		go func() {
			defer close(released)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "SELECT 1 FROM outbox WHERE id = $1 FOR NO KEY UPDATE", hot[0].ID); err != nil {
					return err
				}
				close(locked)
				time.Sleep(200 * time.Millisecond)
				return nil
			})
			if err != nil {
				t.Errorf("hold the run's first row: %v", err)
			}
		}()
		<-locked
	}
	cfg := fastConfig(t)
	startRelay(t, pool, pub, cfg)
	<-released
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	rows, err := pool.Query(ctx, "SELECT aggregate_version FROM outbox_published ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	marked, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(marked, []int64{1, 2, 3, 4, 5, 6}) {
		t.Fatalf("marked versions %v, want 1 to 6", marked)
	}
}

package outboxadmin_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

func TestPurgeDeletesOnlyOldPublishedRowsInBatches(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at, attempts, published_at)
SELECT g, 'order', 'o-' || g, 1, 'order.created', '{}', '{}', now(), 1,
       CASE WHEN g <= 25 THEN now() - interval '2 days' ELSE now() - interval '1 hour' END
FROM generate_series(1, 40) g`)
	if err != nil {
		t.Fatal(err)
	}
	admin := outboxadmin.New(pool)
	n, err := admin.Purge(ctx, 24*time.Hour, 10) // three statements: 10, 10, 5
	if err != nil {
		t.Fatal(err)
	}
	if n != 25 {
		t.Fatalf("purged %d rows, want 25", n)
	}
	var left, oldest int
	if err := pool.QueryRow(ctx, "SELECT count(*), min(id) FROM outbox_published").Scan(&left, &oldest); err != nil {
		t.Fatal(err)
	}
	if left != 15 || oldest != 26 {
		t.Fatalf("%d rows left from id %d, want 15 from 26", left, oldest)
	}

	for _, bad := range []struct {
		age   time.Duration
		batch int
	}{{0, 10}, {-time.Hour, 10}, {time.Hour, 0}, {time.Hour, outboxsql.MaxPurgeBatch + 1}} {
		if _, err := admin.Purge(ctx, bad.age, bad.batch); err == nil {
			t.Errorf("Purge(%v, %d) accepted", bad.age, bad.batch)
		}
	}
}

func TestAdminRejectsBadInput(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	admin := outboxadmin.New(pool)
	if _, err := admin.DeadLetters(ctx, 0, 0); err == nil {
		t.Error("limit 0 accepted")
	}
	if _, err := admin.DeadLetters(ctx, 0, outboxadmin.MaxDeadLettersPage+1); err == nil {
		t.Error("limit above the page maximum accepted")
	}
	if _, err := admin.DeadLetters(ctx, -1, 10); err == nil {
		t.Error("negative afterID accepted")
	}
	if err := admin.Retry(ctx, 0); err == nil {
		t.Error("id 0 accepted")
	}
	// A pending row that is not a dead letter is not retried (nor reset).
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]
	if err := admin.Retry(ctx, e.ID); err == nil {
		t.Error("retry of a pending, not dead-lettered row succeeded")
	}
	if n, err := admin.RetryAll(ctx); err != nil || n != 0 {
		t.Errorf("RetryAll with no dead letters = %d, %v", n, err)
	}
	if dls, err := admin.DeadLetters(ctx, 0, 10); err != nil || len(dls) != 0 {
		t.Errorf("dead letters = %v, %v; want none", dls, err)
	}
}

// deadLetter makes the relay dead-letter the event id (its publisher rejects
// it, MaxAttempts 1) and returns the running relay, which publishes the rest.
func deadLetter(t *testing.T, pool *pgxpool.Pool, id int64) (*outbox.Relay, *memPublisher) {
	t.Helper()
	pub := &memPublisher{}
	pub.SetFail(func(e outbox.Envelope) error {
		if e.ID == id {
			return errors.New("schema registry rejected the payload")
		}
		return nil
	})
	dead := make(chan struct{})
	var once sync.Once
	cfg := fastConfig(t)
	cfg.MaxAttempts = 1
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		if slices.Contains(r.DeadLettered, id) {
			once.Do(func() { close(dead) })
		}
	})
	relay := startRelay(t, pool, pub, cfg)
	select {
	case <-dead:
	case <-time.After(10 * time.Second):
		t.Fatalf("event %d not dead-lettered within 10s", id)
	}
	return relay, pub
}

// An event that can never be published is discarded by an operator: it is
// kept in outbox_discarded with the reason, and the aggregate's next events,
// held back behind it, are published in order.
func TestDiscardUnblocksTheAggregatesNextEvent(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	first := enqueue(t, pool, msg("o-1", "order.created"))[0]
	rest := enqueue(t, pool, msg("o-1", "order.paid"), msg("o-1", "order.shipped"))
	relay, pub := deadLetter(t, pool, first.ID)

	var blocked int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE blocked").Scan(&blocked); err != nil {
		t.Fatal(err)
	}
	if blocked != 2 {
		t.Fatalf("%d events blocked behind the dead letter, want 2", blocked)
	}

	// The first attempt of the event took the next ones along (a run): the
	// broker took them, and they were not marked, as the event failed.
	sentBefore := len(pub.Snapshot())
	admin := outboxadmin.New(pool)
	const reason = "payload rejected by the schema registry; order o-1 re-sent by hand"
	if err := admin.Discard(ctx, first.ID, reason); err != nil {
		t.Fatalf("Discard: %v", err)
	}
	relay.Wake()
	waitFor(t, "the aggregate's next events published", 10*time.Second, outboxEmpty(pool))
	var got []int64
	for _, e := range pub.Snapshot()[sentBefore:] {
		got = append(got, e.ID)
	}
	if want := []int64{rest[0].ID, rest[1].ID}; !slices.Equal(got, want) {
		t.Fatalf("published %v, want %v (the discarded %d never)", got, want, first.ID)
	}

	var (
		d       outboxadmin.DeadLetter
		dReason string
		age     time.Duration
	)
	err := pool.QueryRow(ctx, `
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, attempts,
       coalesce(last_error, ''), created_at, dead_lettered_at, reason, now() - discarded_at
FROM outbox_discarded`).Scan(&d.ID, &d.AggregateType, &d.AggregateID, &d.AggregateVersion, &d.EventType,
		&d.Payload, &d.Headers, &d.Attempts, &d.LastError, &d.CreatedAt, &d.DeadLetteredAt, &dReason, &age)
	if err != nil {
		t.Fatalf("read the discard record: %v", err)
	}
	m := msg("o-1", "order.created")
	if d.ID != first.ID || d.AggregateID != "o-1" || d.AggregateVersion != 1 || d.EventType != "order.created" ||
		!sameJSON(d.Payload, m.Payload) || d.Headers["traceparent"] != m.Headers["traceparent"] || d.Attempts != 1 ||
		!strings.Contains(d.LastError, "schema registry") || d.DeadLetteredAt.IsZero() || dReason != reason || age < 0 || age > time.Minute {
		t.Fatalf("discard record = %+v reason %q %v ago", d, dReason, age)
	}
	var version int64
	if err := pool.QueryRow(ctx, `SELECT version FROM outbox_aggregates WHERE aggregate_id = 'o-1'`).
		Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version != 3 {
		t.Fatalf("aggregate version %d, want 3", version)
	}
	// The next event of the aggregate follows on.
	if v := enqueue(t, pool, msg("o-1", "order.delivered"))[0].AggregateVersion; v != 4 {
		t.Fatalf("next event got version %d, want 4", v)
	}
}

// Discard takes the aggregate's lock, waiting for a writer that holds it: the
// writer's event, committed while Discard waited, is unblocked, not stranded.
func TestDiscardWaitsForAWriterHoldingTheAggregate(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	first := enqueue(t, pool, msg("o-1", "order.created"))[0]
	deadLetter(t, pool, first.ID)

	second := discardWhileAWriterHoldsTheEvent(t, pool, pool, first.ID)
	waitFor(t, "the writer's event published", 10*time.Second, outboxEmpty(pool))
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published WHERE id = $1", second.ID).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the writer's event is not published: %d, %v", n, err)
	}
}

// Discard relies on a snapshot taken after its lock was granted. On a server
// (or role) whose default_transaction_isolation is REPEATABLE READ, a writer
// at READ COMMITTED that committed while Discard waited must still have its
// event unblocked, not stranded behind the discarded one.
func TestDiscardUnblocksTheWaitedWriterUnderARepeatableReadDefault(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	first := enqueue(t, pool, msg("o-1", "order.created"))[0]
	deadLetter(t, pool, first.ID)

	cfg := pool.Config()
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	rrPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer rrPool.Close()

	second := discardWhileAWriterHoldsTheEvent(t, pool, rrPool, first.ID)
	var blocked bool
	if err := pool.QueryRow(ctx, "SELECT blocked FROM outbox WHERE id = $1", second.ID).Scan(&blocked); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatal(err)
	}
	if blocked {
		t.Fatalf("event %d is still blocked, behind the discarded %d", second.ID, first.ID)
	}
}

// discardWhileAWriterHoldsTheEvent discards the dead letter firstID through
// an Admin on adminPool while a writer at READ COMMITTED, on pool, holds it
// (it enqueued the aggregate's next event and has not committed): it waits
// until Discard is blocked by the writer, commits the writer, and returns the
// writer's event once Discard returned.
func discardWhileAWriterHoldsTheEvent(t *testing.T, pool, adminPool *pgxpool.Pool, firstID int64) outbox.Enqueued {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	second, err := new(outbox.Writer).Enqueue(ctx, tx, msg("o-1", "order.cancelled"))
	if err != nil {
		t.Fatal(err)
	}
	var writerPID int32
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&writerPID); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- outboxadmin.New(adminPool).Discard(ctx, firstID, "never publishable") }()
	waitFor(t, "Discard waiting for the writer", 10*time.Second, func() (bool, error) {
		var waiting bool
		err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)))", writerPID).Scan(&waiting)
		return waiting, err
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Discard: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Discard did not return after the writer committed")
	}
	return second[0]
}

// Only a dead letter can be discarded: a pending event, a missing id and bad
// arguments are errors, and nothing changes.
func TestDiscardRejectsWhatIsNotADeadLetter(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	admin := outboxadmin.New(pool)
	e := enqueue(t, pool, msg("o-1", "order.created"), msg("o-1", "order.paid"))

	snapshot := func() string {
		var s string
		err := pool.QueryRow(ctx, `
SELECT (SELECT coalesce(json_agg(o ORDER BY id), '[]')::text FROM outbox o) ||
       (SELECT json_agg(a)::text FROM outbox_aggregates a) ||
       (SELECT count(*)::text FROM outbox_discarded)`).Scan(&s)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := snapshot()
	for _, tc := range []struct {
		name   string
		id     int64
		reason string
		is     error
	}{
		{"pending event", e[0].ID, "stuck", outboxadmin.ErrNotDeadLettered},
		{"blocked event", e[1].ID, "stuck", outboxadmin.ErrNotDeadLettered},
		{"missing id", e[1].ID + 1000, "stuck", outboxadmin.ErrNotFound},
		{"id 0", 0, "stuck", nil},
		{"empty reason", e[0].ID, "", nil},
		{"reason over the limit", e[0].ID, strings.Repeat("r", outboxadmin.MaxDiscardReasonBytes+1), nil},
		{"reason not UTF-8", e[0].ID, "\xff", nil},
	} {
		err := admin.Discard(ctx, tc.id, tc.reason)
		switch {
		case err == nil:
			t.Errorf("%s: discarded", tc.name)
		case tc.is != nil && !errors.Is(err, tc.is):
			t.Errorf("%s: error %v, want %v", tc.name, err, tc.is)
		}
	}
	if after := snapshot(); after != before {
		t.Fatalf("rejected discards changed the outbox:\nbefore %s\nafter  %s", before, after)
	}
}

// Status runs on every metrics scrape of every process: with a large backlog
// (a broker outage) it must read a bounded part of it, not scan it all, also
// on a connection that planned it while the outbox was empty. Measured in rows
// PostgreSQL read from outbox, by its own statistics.
func TestStatusReadsABoundedPartOfALargeBacklog(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	for range 6 { // past the server's first custom plans of a prepared statement
		if _, err := outboxadmin.New(conn).Status(ctx); err != nil {
			t.Fatal(err)
		}
	}
	_, err = pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, blocked)
SELECT 'order', 'o-' || (g % 10000), g / 10000 + 1, 'order.created', '{}', g >= 10000
FROM generate_series(0, 99999) g`)
	if err != nil {
		t.Fatal(err)
	}
	rowsRead := func() int64 {
		t.Helper()
		// The backend reports its counts when it goes idle after this, at once.
		if _, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			t.Fatal(err)
		}
		var n int64
		if err := pool.QueryRow(ctx, `SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables
			WHERE relid = 'outbox'::regclass`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := rowsRead()
	st, err := outboxadmin.New(conn).Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if read := rowsRead() - before; read > 3*outboxadmin.StatusCountLimit {
		t.Fatalf("Status read %d rows of a 100,000-row backlog (status %+v)", read, st)
	}
}

// Status is exact up to StatusCountLimit pending rows and an estimate above,
// as documented on outboxadmin.Status.
func TestStatusIsExactBelowTheCountLimitAndEstimatedAbove(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	admin := outboxadmin.New(pool)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// insert runs sql on conn and makes PostgreSQL's statistics count it now.
	insert := func(sql string, args ...any) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			t.Fatal(err)
		}
	}
	status := func() outboxadmin.Status {
		t.Helper()
		st, err := admin.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	within := func(d, want time.Duration) bool { return d >= want && d < want+time.Minute }

	if st := status(); st != (outboxadmin.Status{}) {
		t.Fatalf("empty outbox: %+v", st)
	}

	// Three old dead letters first in id order, then 50 pending rows whose
	// oldest has the largest id.
	insert(`
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, created_at, dead_lettered_at)
SELECT 'order', 'dead-' || g, 1, 'order.created', '{}', now() - interval '3 hours', now()
FROM generate_series(1, 3) g;
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, created_at)
SELECT 'order', 'o-' || g, 1, 'order.created', '{}', now() - g * interval '1 minute'
FROM generate_series(1, 50) g`)
	st := status()
	if st.Pending != 50 || st.PendingEstimated || st.DeadLettered != 3 || !within(st.OldestPendingAge, 50*time.Minute) {
		t.Fatalf("50 pending, 3 dead letters: %+v; want exact counts and the oldest pending row's age, 50m", st)
	}

	// Over the limit: the statistics' estimate, exact here since they counted
	// every insert; the age is the first pending row's in id order (1m).
	insert(`
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT 'order', 'p-' || g, 1, 'order.created', '{}' FROM generate_series(1, $1::int) g`, outboxadmin.StatusCountLimit)
	st = status()
	if st.Pending != outboxadmin.StatusCountLimit+50 || !st.PendingEstimated || st.DeadLettered != 3 || !within(st.OldestPendingAge, time.Minute) {
		t.Fatalf("%d pending, 3 dead letters: %+v; want an estimate of the same, 3 dead letters, age 1m",
			outboxadmin.StatusCountLimit+50, st)
	}

	// Dead letters over the limit are reported as the limit + 1.
	insert(`
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, dead_lettered_at)
SELECT 'order', 'dl-' || g, 1, 'order.created', '{}', now() FROM generate_series(1, $1::int) g`, outboxadmin.StatusCountLimit)
	if st = status(); st.DeadLettered != outboxadmin.StatusCountLimit+1 {
		t.Fatalf("%d dead letters: %+v; want DeadLettered %d", outboxadmin.StatusCountLimit+3, st, outboxadmin.StatusCountLimit+1)
	}
}

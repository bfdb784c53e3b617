package outboxwal_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// fillOutbox writes n events of n aggregates (bulk-1 ... bulk-n, version 1)
// in one statement, as a busy table holds them: what Enqueue would write,
// without its cost per row.
func fillOutbox(t testing.TB, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := context.Background()
	for _, q := range []string{
		`INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, version)
		 SELECT 'order', 'bulk-' || g, 1 FROM generate_series(1, $1::int) g`,
		`INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
		 SELECT 'order', 'bulk-' || g, 1, 'order.created', jsonb_build_object('n', g), '{}' FROM generate_series(1, $1::int) g`,
	} {
		if _, err := pool.Exec(ctx, q, n); err != nil {
			t.Fatalf("fill the outbox: %v", err)
		}
	}
	if _, err := pool.Exec(ctx, `ANALYZE outbox`); err != nil {
		t.Fatalf("fill the outbox: %v", err)
	}
}

// A WAL relay started on an outbox with a large backlog streams: the rows
// older than its slot are handed over to polling in bounded steps, beside
// the stream, and an event of another aggregate goes out at once while an
// event of an aggregate with an old row waits behind it. It used to hand the
// whole backlog over in one statement under a 10 s deadline, which a million
// rows exceed: the slot was dropped and made again for ever, and nothing was
// published (this test then times out waiting for the relay to stream).
// make bench's relay_start_backlog measures the whole drain.
func TestALargeBacklogDoesNotStopTheStart(t *testing.T) {
	n := 1_000_000
	if v, err := strconv.Atoi(os.Getenv("TEST_WAL_BACKLOG_ROWS")); err == nil {
		n = v
	}
	pool := walPool(t)
	fillOutbox(t, pool, n)
	rec := outboxtest.NewRecorder()
	cfg := walConfig(t, pool)
	start := time.Now()
	relay, _ := startWAL(t, pool, rec, cfg)
	waitActive(t, relay)
	t.Logf("streaming %v after the start", time.Since(start).Round(time.Millisecond))

	// An aggregate with no old row goes out from the stream while the
	// backlog is handed over, and polling publishes the backlog as it is
	// handed over; bulk-1's version 2 waits behind its version 1, the
	// backlog's first row (and goes out in due order, behind the backlog).
	fresh := enqueue(t, pool, msg("fresh", "order.created"))
	enqueue(t, pool, msg("bulk-1", "order.cancelled"))
	if _, ok := rec.Wait(fresh[0].ID, longWait); !ok {
		t.Fatalf("an event of an aggregate with no old row was not published within %v", longWait)
	}
	waitFor(t, "20,000 rows of the backlog published", 2*longWait, func() (bool, error) { return rec.Distinct() >= 20_000, nil })
	var first int64
	for _, e := range rec.Published() {
		if e.AggregateID == "bulk-1" {
			first = e.AggregateVersion
			break
		}
	}
	if first != 1 {
		t.Fatalf("bulk-1's first published event is version %d, want 1", first)
	}
	t.Logf("%d events published %v after the start", rec.Distinct(), time.Since(start).Round(time.Millisecond))
}

// A session that takes a slot it cannot vouch for on this server (a slot an
// operator made, or one last used on another server: after a failover or a
// restore) hands every row of the outbox over to polling: the slot's stream
// may not hold them. It used to do so in one statement under a 10 s
// deadline, after recording the server as its own: with a large outbox the
// statement timed out, and the next session, finding its server recorded,
// handed nothing over, so the rows below the slot's position were never
// published. Here the slot is an operator's, made after the rows were
// written: only the hand-over can publish them.
func TestALargeOutboxIsAdoptedInSteps(t *testing.T) {
	n := 1_000_000
	if v, err := strconv.Atoi(os.Getenv("TEST_WAL_BACKLOG_ROWS")); err == nil {
		n = v
	}
	ctx := context.Background()
	pool := walPool(t)
	fillOutbox(t, pool, n)
	rec := outboxtest.NewRecorder()
	cfg := walConfig(t, pool)
	if _, err := pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, cfg.Slot); err != nil {
		t.Fatal(err)
	}
	relay, _ := startWAL(t, pool, rec, cfg)
	waitActive(t, relay)
	fresh := enqueue(t, pool, msg("fresh", "order.created"))
	waitFor(t, "20,000 rows of the outbox published", 2*longWait, func() (bool, error) { return rec.Distinct() >= 20_000, nil })
	if _, ok := rec.Wait(fresh[0].ID, longWait); !ok {
		t.Fatalf("an event of an aggregate with no old row was not published within %v", longWait)
	}
}

// A hand-over stopped half-way (the relay stopped, crashed or lost the slot)
// is not lost: what was marked stays with polling, and the next session
// lists and marks the rest.
func TestAHandOverStoppedHalfwayResumes(t *testing.T) {
	const n = 100_000
	ctx := context.Background()
	pool := walPool(t)
	fillOutbox(t, pool, n)
	rec := outboxtest.NewRecorder()
	cfg := walConfig(t, pool)
	cfg.Poll.PollInterval = time.Hour // polling publishes nothing in the first session
	relay, stop := startWAL(t, pool, rec, cfg)
	handed := func() int {
		var k int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE handed_over`).Scan(&k); err != nil {
			t.Fatal(err)
		}
		return k
	}
	waitFor(t, "part of the backlog handed over", longWait, func() (bool, error) { return handed() > 0, nil })
	stop()
	_ = relay
	k := handed()
	if k >= n {
		t.Skipf("the whole backlog (%d rows) was handed over before the relay stopped; nothing to resume", n)
	}
	t.Logf("stopped with %d of %d rows handed over", k, n)
	cfg.Poll.PollInterval = 50 * time.Millisecond
	startWAL(t, pool, rec, cfg)
	waitFor(t, "every row published", 4*longWait, func() (bool, error) { return rec.Distinct() >= n, nil })
	waitFor(t, "the outbox swept", longWait, outboxEmpty(pool))
}

// An operator's slot made before the relay makes its publication holds
// changes written before the publication existed. pgoutput looks the
// publication up as of each change it decodes, so on PostgreSQL before 18
// the stream fails at the first such change ("publication does not exist"),
// at every reconnect: the slot never moves on, it retains WAL for ever, and
// only the hand-over of each new session publishes anything.
func TestAnOperatorsSlotMadeBeforeThePublicationMovesOn(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	rec := outboxtest.NewRecorder()
	cfg := walConfig(t, pool)
	if _, err := pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, cfg.Slot); err != nil {
		t.Fatal(err)
	}
	old := enqueue(t, pool, msg("old", "order.created")) // decoded before the publication exists
	relay, _ := startWAL(t, pool, rec, cfg)
	waitActive(t, relay)
	fresh := enqueue(t, pool, msg("fresh", "order.created"))
	after := currentLSN(t, pool)
	waitFor(t, "the slot acknowledged past the fresh event", longWait, func() (bool, error) {
		var past bool
		err := pool.QueryRow(ctx, `SELECT coalesce(confirmed_flush_lsn >= $2::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1`,
			cfg.Slot, after).Scan(&past)
		return past, err
	})
	for _, e := range append(old, fresh...) {
		if _, ok := rec.Wait(e.ID, longWait); !ok {
			t.Fatalf("event %d was not published", e.ID)
		}
	}
}

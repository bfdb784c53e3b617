package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// orderCreated is an event of the size the orders service writes (about 400
// bytes of payload, a traceparent header).
func orderCreated(i int) outbox.Message {
	m := msg(fmt.Sprintf("ord-%06d", i), "order.created")
	m.Payload = fmt.Appendf(nil, `{"order_id":"ord-%06d","customer_id":"c-%d","currency":"EUR","total":2500,"items":[%s],"created_at":"2026-12-05T10:00:00Z"}`,
		i, i%1000, strings.Repeat(`{"sku":"sku-1","quantity":2,"unit_price":1250},`, 6)+`{"sku":"sku-2","quantity":1,"unit_price":0}`)
	return m
}

// At a steady rate each event is written, claimed and moved out within
// milliseconds. Between two vacuums the outbox grows: the space of the rows
// moved out comes back to writers only once a vacuum records it. It must
// grow no faster than the same rows written packed: the claim's update is HOT
// (the row's new version on its own page, no index entries), on room that
// PostgreSQL frees by pruning the page of the rows already moved out when the
// claim reads it. A fillfactor below 100 breaks this: a writer leaves each
// page once it is filled to the fillfactor and comes back only after a
// vacuum, so the table grows several times faster, and a claim planned as a
// scan of the table (the planner's choice on a table it sees as nearly empty)
// reads every page of it.
func TestOutboxGrowsNoFasterThanItsRowsBetweenVacuums(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	cfg := fastConfig(t)
	cfg.VacuumEvery = -1 // no vacuum during the test (the server's thresholds are 5,000 changes)
	relay := startRelay(t, pool, &outboxtest.MemPublisher{}, cfg)
	const n = 2000
	tick := time.NewTicker(2 * time.Millisecond) // 500 events/s, as bench's claim_flat
	defer tick.Stop()
	for i := range n {
		<-tick.C
		enqueue(t, pool, orderCreated(i))
		relay.Wake()
		if i%20 == 19 {
			// A steady rate is one the relay keeps up with: on a loaded
			// machine, wait for it rather than write a backlog.
			waitFor(t, "the relay to keep up", time.Minute, func() (bool, error) { return countRows(t, pool) <= 20, nil })
		}
	}
	waitFor(t, "outbox drained", time.Minute, outboxEmpty(pool))

	// PostgreSQL flushes a backend's counts at most once a second, and
	// after 10 s when it is idle.
	var updated, hot int64
	waitFor(t, "the claims' updates counted", 30*time.Second, func() (bool, error) {
		err := pool.QueryRow(ctx, `SELECT pg_stat_get_tuples_updated('outbox'::regclass), pg_stat_get_tuples_hot_updated('outbox'::regclass)`).Scan(&updated, &hot)
		return updated >= n, err
	})
	// The same rows, packed: copies of the published ones in a table like
	// the outbox.
	var pages, packed, vacuums int64
	if err := pool.QueryRow(ctx, `SELECT pg_relation_size('outbox') / current_setting('block_size')::int,
       pg_stat_get_vacuum_count('outbox'::regclass) + pg_stat_get_autovacuum_count('outbox'::regclass)`).Scan(&pages, &vacuums); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE packed (LIKE outbox INCLUDING DEFAULTS);
INSERT INTO packed (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at)
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at FROM outbox_published`); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT pg_relation_size('packed') / current_setting('block_size')::int`).Scan(&packed); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d events at 500/s: %d updates of the outbox, %d of them HOT; the outbox holds %d pages, the same rows packed %d (vacuumed %d times)",
		n, updated, hot, pages, packed, vacuums)
	if vacuums != 0 {
		t.Fatalf("the outbox was vacuumed %d times: the test needs none", vacuums)
	}
	if pages > packed*3/2 {
		t.Errorf("the outbox grew to %d pages for %d events that went through it, %.1f times the %d pages they take packed; want at most 1.5 times", pages, n, float64(pages)/float64(packed), packed)
	}
	if hot < updated*8/10 {
		t.Errorf("%d of the %d updates of the outbox were HOT, want at least 80%%", hot, updated)
	}
}

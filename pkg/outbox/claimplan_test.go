package outbox_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// The claim reads about as many index entries as it returns, however long the
// backlog and however many events wait behind an in-flight one: measured on the
// plan of 100k pending rows across 20k aggregates plus one aggregate with 20k
// events queued behind its in-flight head. A lease leaves the head's entry in
// outbox_due, first in due order: the claim reads it and skips it.
func TestClaimPlanReadsOnlyHeadsWithALargeBacklog(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	// Rows as Enqueue writes them: an aggregate's later events are blocked.
	_, err := pool.Exec(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, blocked, created_at, next_attempt_at)
SELECT 'order', 'o-' || (g % 20000), g / 20000 + 1, 'order.created', '{}', g >= 20000,
       now() - interval '1 hour' + g * interval '1 ms', now() - interval '1 hour' + g * interval '1 ms'
FROM generate_series(0, 99999) g;
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, blocked, created_at, next_attempt_at,
                    leased_until, attempts, in_flight)
SELECT 'order', 'hot', g, 'order.updated', '{}', g > 1,
       now() - interval '2 hours', now() - interval '2 hours', CASE WHEN g = 1 THEN now() + interval '30 seconds' ELSE '-infinity' END,
       CASE WHEN g = 1 THEN 1 ELSE 0 END, g = 1
FROM generate_series(1, 20000) g;
ANALYZE outbox;`)
	if err != nil {
		t.Fatal(err)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // EXPLAIN ANALYZE runs the claim: undo it
	var plan []struct {
		Plan          planNode `json:"Plan"`
		ExecutionTime float64  `json:"Execution Time"`
	}
	if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+outbox.ClaimSQL, claimArgs(500, 30*time.Second)...).Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var dueScan *planNode
	var walk func(n *planNode)
	walk = func(n *planNode) {
		if n.NodeType == "Seq Scan" {
			t.Errorf("claim plan has a sequential scan on %s", n.RelationName)
		}
		if n.IndexName == "outbox_due" {
			dueScan = n
		}
		for i := range n.Plans {
			walk(&n.Plans[i])
		}
	}
	walk(&plan[0].Plan)
	if dueScan == nil {
		b, _ := json.MarshalIndent(plan, "", "  ")
		t.Fatalf("claim does not scan outbox_due:\n%s", b)
	}
	if read := dueScan.ActualRows + dueScan.RowsRemovedByFilter; read > 501 {
		t.Errorf("claim read %v entries of outbox_due to return 500 rows with one in flight", read)
	}
	if dueScan.RowsRemovedByFilter != 1 {
		t.Errorf("claim skipped %v entries of outbox_due, want the in-flight head's", dueScan.RowsRemovedByFilter)
	}
	if plan[0].Plan.ActualRows != 500 {
		t.Errorf("claim returned %v rows, want 500", plan[0].Plan.ActualRows)
	}
	t.Logf("claim of 500 over 120k pending rows: %.1f ms, %v shared buffers hit", plan[0].ExecutionTime, plan[0].Plan.SharedHitBlocks)
}

// The claim's update of a row changes no indexed column and finds room on
// the row's page, so it is HOT: no index entries per claimed row. Rows the
// size of the orders service's order.created (a JSON payload of about 220
// bytes and a traceparent header), claimed in a batch of 500 as the relay
// claims them.
func TestClaimUpdatesAreHOT(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	// A backlog written packed leaves no room for a HOT update: here the
	// pages keep half of their space free, so that only an index the
	// claim's update changed would keep it from being HOT.
	_, err := pool.Exec(ctx, `
ALTER TABLE outbox SET (fillfactor = 50);
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
SELECT 'order', 'ord-' || md5(g::text), 1, 'order.created',
       jsonb_build_object('order_id', md5(g::text), 'customer_id', 'c-' || g % 1000, 'currency', 'EUR', 'total', 2500,
                          'items', jsonb_build_array(jsonb_build_object('sku', 'sku-1', 'quantity', 2, 'unit_price', 1250)),
                          'created_at', now()::text),
       jsonb_build_object('traceparent', '00-' || md5(g::text) || '-' || left(md5((g + 1)::text), 16) || '-01')
FROM generate_series(1, 2000) g`)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // read-only but for the claim: undo it
	rows, err := tx.Query(ctx, outbox.ClaimSQL, claimArgs(500, 30*time.Second)...)
	if err != nil {
		t.Fatal(err)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var updated, hot int
	if err := tx.QueryRow(ctx, `SELECT pg_stat_get_xact_tuples_updated('outbox'::regclass),
       pg_stat_get_xact_tuples_hot_updated('outbox'::regclass)`).Scan(&updated, &hot); err != nil {
		t.Fatal(err)
	}
	if updated != 500 || hot != updated {
		t.Fatalf("the claim updated %d rows, %d of them HOT; want 500, all HOT", updated, hot)
	}
}

type planNode struct {
	NodeType     string  `json:"Node Type"`
	RelationName string  `json:"Relation Name"`
	IndexName    string  `json:"Index Name"`
	ActualRows   float64 `json:"Actual Rows"`
	// RowsRemovedByFilter is what the node read and its filter dropped.
	RowsRemovedByFilter float64    `json:"Rows Removed by Filter"`
	SharedHitBlocks     float64    `json:"Shared Hit Blocks"`
	Plans               []planNode `json:"Plans"`
}

func TestRelayPurgesOldPublishedRows(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	enqueue(t, pool, msg("o-1", "order.created"), msg("o-2", "order.created"))
	cfg := fastConfig(t)
	cfg.PublishedRetention = time.Hour
	cfg.PurgeInterval = 20 * time.Millisecond
	cfg.PurgeBatchSize = 1
	startRelay(t, pool, &memPublisher{}, cfg)
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	// Age one of the two published rows past the retention.
	if _, err := pool.Exec(ctx, "UPDATE outbox_published SET published_at = now() - interval '2 hours' WHERE aggregate_id = 'o-1'"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "old row purged", 10*time.Second, func() (bool, error) {
		var ids []string
		rows, err := pool.Query(ctx, "SELECT aggregate_id FROM outbox_published")
		if err != nil {
			return false, err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return false, err
		}
		if len(ids) == 1 && ids[0] != "o-2" {
			t.Fatalf("the recent row was purged, %v left", ids)
		}
		return len(ids) == 1, nil
	})
}

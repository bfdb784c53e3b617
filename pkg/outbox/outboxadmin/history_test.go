package outboxadmin_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

func historyOf(events []outboxadmin.HistoryEvent) string {
	var b strings.Builder
	for _, e := range events {
		fmt.Fprintf(&b, "v%d:%d:%s:%s ", e.AggregateVersion, e.ID, e.EventType, e.State)
	}
	return strings.TrimSpace(b.String())
}

// History reads an aggregate's events from the three tables, in version
// order, each with its state and what its state says of it.
func TestAdminHistory(t *testing.T) {
	t.Parallel()
	pool := outboxtest.EveryState(t)
	ctx := context.Background()
	admin := outboxadmin.New(pool)

	h, err := admin.History(ctx, "order", "o-6")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := historyOf(h), "v1:6:order.created:dead_lettered v2:8:order.cancelled:pending"; got != want {
		t.Fatalf("o-6: %q, want %q", got, want)
	}
	dead, pending := h[0], h[1]
	if dead.Attempts != 1 || !strings.Contains(dead.LastError, "refused") || dead.DeadLetteredAt.IsZero() ||
		!dead.Since.Equal(dead.DeadLetteredAt) || !dead.NextAttemptAt.IsZero() || dead.InFlight {
		t.Errorf("dead letter: %+v", dead)
	}
	if pending.Attempts != 0 || pending.LastError != "" || pending.NextAttemptAt.IsZero() || !pending.Since.IsZero() ||
		!pending.DeadLetteredAt.IsZero() || pending.InFlight {
		t.Errorf("pending event blocked behind the dead letter: %+v", pending)
	}
	if got := pending.Headers["traceparent"]; !strings.HasPrefix(got, "00-0af7651916cd43dd8448eb211c80319c-") {
		t.Errorf("headers %v: want the writer's traceparent", pending.Headers)
	}

	h, err = admin.History(ctx, "order", "o-1")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := historyOf(h), "v1:1:order.created:published"; got != want {
		t.Fatalf("o-1: %q, want %q", got, want)
	}
	if e := h[0]; e.Since.IsZero() || e.Attempts != 1 || e.LastError != "" || !e.DeadLetteredAt.IsZero() {
		t.Errorf("published event: %+v", e)
	}
	var created time.Time
	if err := pool.QueryRow(ctx, "SELECT created_at FROM outbox_published WHERE id = 1").Scan(&created); err != nil {
		t.Fatal(err)
	}
	if h[0].MessageID() != outbox.MessageID(1, created) {
		t.Errorf("message id %q, want %q", h[0].MessageID(), outbox.MessageID(1, created))
	}

	h, err = admin.History(ctx, "order", "o-7")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := historyOf(h), "v1:7:order.created:discarded"; got != want {
		t.Fatalf("o-7: %q, want %q", got, want)
	}
	if e := h[0]; e.DeadLetteredAt.IsZero() || e.Since.Before(e.DeadLetteredAt) || !strings.Contains(e.LastError, "refused") {
		t.Errorf("discarded event: %+v", e)
	}

	for _, other := range [][2]string{{"order", "o-404"}, {"invoice", "o-1"}} {
		if h, err := admin.History(ctx, other[0], other[1]); err != nil || len(h) != 0 {
			t.Errorf("History(%s %s) = %v, %v; want nothing", other[0], other[1], h, err)
		}
	}
	if _, err := outboxadmin.New(newSchemaPool(t)).History(ctx, "order", "o-1"); err == nil || !strings.Contains(err.Error(), "outbox history") {
		t.Errorf("History without the tables: %v, want an error naming the operation", err)
	}
}

// History keeps an aggregate's most recent MaxHistory events.
func TestAdminHistoryKeepsTheMostRecent(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	msgs := make([]outbox.Message, outboxsql.MaxHistory+2)
	for i := range msgs {
		msgs[i] = msg("hot", "order.updated")
	}
	enqueue(t, pool, msgs...)
	h, err := outboxadmin.New(pool).History(context.Background(), "order", "hot")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != outboxsql.MaxHistory || h[0].AggregateVersion != 3 || h[len(h)-1].AggregateVersion != outboxsql.MaxHistory+2 {
		t.Fatalf("%d events, versions %d to %d; want %d, 3 to %d", len(h), h[0].AggregateVersion, h[len(h)-1].AggregateVersion,
			outboxsql.MaxHistory, outboxsql.MaxHistory+2)
	}
}

// A claimed event is pending and in flight until its outcome is written,
// with the claim's attempt counted.
func TestAdminHistoryShowsAClaimInFlight(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	enqueue(t, pool, msg("o-1", "order.created"))
	claimed, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	pub := &memPublisher{Block: func(ctx context.Context) {
		once.Do(func() { close(claimed) })
		select {
		case <-release:
		case <-ctx.Done():
		}
	}}
	cfg := fastConfig(t)
	cfg.Lease, cfg.PublishTimeout = time.Minute, 30*time.Second
	startRelay(t, pool, pub, cfg)
	t.Cleanup(func() { close(release) }) // before the relay stops
	select {
	case <-claimed:
	case <-time.After(30 * time.Second):
		t.Fatal("event not claimed within 30s")
	}
	h, err := outboxadmin.New(pool).History(ctx, "order", "o-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 1 || h[0].State != outbox.EventPending || !h[0].InFlight || h[0].Attempts != 1 {
		t.Fatalf("history %+v: want one pending event, in flight, at attempt 1", h)
	}
}

// History reads one aggregate's published events through an index: its plan
// over 100k published events of 10k aggregates has no sequential scan of
// outbox_published, which would read every published event for each call.
func TestAdminHistoryReadsPublishedEventsThroughAnIndex(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at, attempts, published_at)
SELECT g, 'order', 'o-' || (g % 10000), g / 10000 + 1, 'order.updated', '{}', '{}',
       now() - interval '1 day' + g * interval '1 ms', 1, now() - interval '1 day' + g * interval '1 ms'
FROM generate_series(0, 99999) g;
ANALYZE outbox_published;`); err != nil {
		t.Fatal(err)
	}

	var plan []struct {
		Plan planNode `json:"Plan"`
	}
	if err := pool.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+outboxsql.HistorySQL, "order", "o-42").Scan(&plan); err != nil {
		t.Fatal(err)
	}
	var indexed bool
	var walk func(n *planNode)
	walk = func(n *planNode) {
		if n.RelationName == "outbox_published" {
			if n.NodeType == "Seq Scan" {
				t.Errorf("History's plan scans outbox_published sequentially")
			} else {
				indexed = true
			}
		}
		for i := range n.Plans {
			walk(&n.Plans[i])
		}
	}
	walk(&plan[0].Plan)
	if !indexed {
		b, _ := json.MarshalIndent(plan, "", "  ")
		t.Fatalf("History's plan does not read outbox_published through an index:\n%s", b)
	}
	if plan[0].Plan.ActualRows != 10 {
		t.Errorf("History's query returned %v rows, want the aggregate's 10", plan[0].Plan.ActualRows)
	}

	h, err := outboxadmin.New(pool).History(ctx, "order", "o-42")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 10 || h[0].AggregateVersion != 1 || h[9].AggregateVersion != 10 || h[0].State != outbox.EventPublished {
		t.Fatalf("History of o-42: %s", historyOf(h))
	}
}

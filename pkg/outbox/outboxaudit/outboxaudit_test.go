package outboxaudit_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// eventLogFixture is an outbox holding an event in each state: ids 1..5
// published, 6 dead-lettered, 7 discarded, 8 pending.
var eventLogFixture = outboxtest.EveryState

func collect(t *testing.T, seq func(yield func(outboxaudit.LoggedEvent, error) bool)) []outboxaudit.LoggedEvent {
	t.Helper()
	var out []outboxaudit.LoggedEvent
	for e, err := range seq {
		if err != nil {
			t.Fatalf("Events: %v", err)
		}
		out = append(out, e)
	}
	return out
}

func statesOf(events []outboxaudit.LoggedEvent) string {
	var b strings.Builder
	for _, e := range events {
		fmt.Fprintf(&b, "%d:%s ", e.ID, e.State)
	}
	return strings.TrimSpace(b.String())
}

// Every event is read once, in id order, with its state, across pages that
// split the tables anywhere; a window selects by id and creation time.
func TestEventLogReadsEveryStateInPages(t *testing.T) {
	t.Parallel()
	pool := eventLogFixture(t)
	ctx := context.Background()
	const all = "1:published 2:published 3:published 4:published 5:published 6:dead_lettered 7:discarded 8:pending"
	for _, size := range []int{1, 2, 3, 7, 0} {
		log, err := outboxaudit.NewEventLog(pool, size)
		if err != nil {
			t.Fatal(err)
		}
		if got := statesOf(collect(t, log.Events(ctx, outboxaudit.EventWindow{}))); got != all {
			t.Fatalf("page size %d: events %q, want %q", size, got, all)
		}
	}

	log, err := outboxaudit.NewEventLog(pool, 2)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := statesOf(collect(t, log.Events(ctx, outboxaudit.EventWindow{MinID: 4, MaxID: 6}))), "4:published 5:published 6:dead_lettered"; got != want {
		t.Fatalf("ids 4..6: %q, want %q", got, want)
	}

	// Creation times: move event 3 an hour back and event 5 an hour ahead.
	var now time.Time
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox_published SET created_at = created_at - interval '1 hour' WHERE id = 3`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox_published SET created_at = created_at + interval '1 hour' WHERE id = 5`); err != nil {
		t.Fatal(err)
	}
	w := outboxaudit.EventWindow{Since: now.Add(-30 * time.Minute), Until: now.Add(30 * time.Minute)}
	if got, want := statesOf(collect(t, log.Events(ctx, w))), "1:published 2:published 4:published 6:dead_lettered 7:discarded 8:pending"; got != want {
		t.Fatalf("window %v: %q, want %q", w, got, want)
	}

	// Each state's time: published_at, dead_lettered_at, discarded_at;
	// none for a pending event.
	for _, e := range collect(t, log.Events(ctx, outboxaudit.EventWindow{})) {
		if e.CreatedAt.IsZero() || e.Since.IsZero() != (e.State == outbox.EventPending) {
			t.Errorf("event %d (%s): since %v, created_at %v: want both set", e.ID, e.State, e.Since, e.CreatedAt)
		}
		agg, version := fmt.Sprintf("o-%d", e.ID), int64(1)
		if e.ID == 8 {
			agg, version = "o-6", 2
		}
		if e.AggregateType != "order" || e.AggregateID != agg || e.AggregateVersion != version {
			t.Errorf("event %d: aggregate %s/%s v%d, want order/%s v%d", e.ID, e.AggregateType, e.AggregateID, e.AggregateVersion, agg, version)
		}
	}

	// Narrow: the same events, states and times, without the aggregate.
	full, narrow := collect(t, log.Events(ctx, outboxaudit.EventWindow{})), collect(t, log.Events(ctx, outboxaudit.EventWindow{Narrow: true}))
	for i := range full {
		full[i].AggregateType, full[i].AggregateID, full[i].AggregateVersion = "", "", 0
	}
	if !slices.EqualFunc(full, narrow, func(a, b outboxaudit.LoggedEvent) bool {
		return a.ID == b.ID && a.State == b.State && a.CreatedAt.Equal(b.CreatedAt) && a.Since.Equal(b.Since) && a.AggregateID == b.AggregateID && a.AggregateType == b.AggregateType && a.AggregateVersion == b.AggregateVersion
	}) {
		t.Errorf("narrow scan %+v, want %+v without the aggregates", narrow, full)
	}

	// Stopping early ends the scan without an error.
	n := 0
	for _, err := range log.Events(ctx, outboxaudit.EventWindow{}) {
		if err != nil {
			t.Fatal(err)
		}
		if n++; n == 3 {
			break
		}
	}
}

func TestEventLogLookup(t *testing.T) {
	t.Parallel()
	pool := eventLogFixture(t)
	ctx := context.Background()
	log, err := outboxaudit.NewEventLog(pool, 0)
	if err != nil {
		t.Fatal(err)
	}
	found, err := log.Lookup(ctx, []int64{8, 1, 42, 7, 6})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := statesOf(found), "1:published 6:dead_lettered 7:discarded 8:pending"; got != want {
		t.Fatalf("Lookup: %q, want %q (42 does not exist)", got, want)
	}
	if e := found[3]; e.AggregateType != "order" || e.AggregateID != "o-6" || e.AggregateVersion != 2 {
		t.Fatalf("event 8: %+v, want order o-6 version 2", e)
	}
	if found, err := log.Lookup(ctx, nil); err != nil || len(found) != 0 {
		t.Fatalf("Lookup(nil) = %v, %v", found, err)
	}
	if _, err := log.Lookup(ctx, make([]int64, outboxaudit.MaxEventLookup+1)); err == nil {
		t.Fatal("Lookup of too many ids: want an error")
	}
}

func TestEventLogErrors(t *testing.T) {
	t.Parallel()
	for _, size := range []int{-1, outboxaudit.MaxEventLogPage + 1} {
		if _, err := outboxaudit.NewEventLog(outboxtest.SchemaPool(t), size); err == nil {
			t.Errorf("NewEventLog(page size %d): want an error", size)
		}
	}
	// Without the tables, the scan yields the error, named, and stops.
	log, err := outboxaudit.NewEventLog(outboxtest.SchemaPool(t), 0)
	if err != nil {
		t.Fatal(err)
	}
	var errs []error
	for _, err := range log.Events(context.Background(), outboxaudit.EventWindow{}) {
		errs = append(errs, err)
	}
	if len(errs) != 1 || errs[0] == nil || !strings.Contains(errs[0].Error(), "outbox event log") {
		t.Fatalf("errors %v: want one, naming the operation", errs)
	}
	if !slices.ContainsFunc(errs, func(err error) bool { return strings.Contains(err.Error(), "does not exist") }) {
		t.Fatalf("errors %v: want the database's", errs)
	}
}

// Counts counts each state in full, in one snapshot.
func TestEventLogCounts(t *testing.T) {
	t.Parallel()
	pool := outboxtest.EveryState(t)
	log, err := outboxaudit.NewEventLog(pool, 0)
	if err != nil {
		t.Fatal(err)
	}
	c, err := log.Counts(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if c.Pending != 1 || c.DeadLettered != 1 || c.Published != 5 || c.Discarded != 1 || c.OldestPendingAge <= 0 {
		t.Fatalf("counts %+v: want 1 pending (with an age), 1 dead letter, 5 published, 1 discarded", c)
	}
	empty, err := outboxaudit.NewEventLog(outboxtest.Pool(t), 0)
	if err != nil {
		t.Fatal(err)
	}
	if c, err := empty.Counts(context.Background()); err != nil || c != (outboxaudit.EventCounts{}) {
		t.Fatalf("an empty outbox: %+v, %v", c, err)
	}
}

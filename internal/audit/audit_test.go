package audit_test

import (
	"context"
	"errors"
	"iter"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// The tests here check the audit's logic on streams made in memory; the
// command's tests (cmd/audit) run it on PostgreSQL, RabbitMQ, FerretDB and
// the shipping service.

// producer is an outbox in memory.
type producer struct {
	events  []outboxaudit.LoggedEvent // by id
	fail    error                     // yielded after the first event
	lookups int
}

func (p *producer) Events(ctx context.Context, w outboxaudit.EventWindow) iter.Seq2[outboxaudit.LoggedEvent, error] {
	return func(yield func(outboxaudit.LoggedEvent, error) bool) {
		for _, e := range p.events {
			if e.ID < w.MinID || w.MaxID != 0 && e.ID > w.MaxID || e.CreatedAt.Before(w.Since) ||
				!w.Until.IsZero() && !e.CreatedAt.Before(w.Until) {
				continue
			}
			if w.Narrow {
				e.AggregateType, e.AggregateID, e.AggregateVersion = "", "", 0
			}
			if !yield(e, nil) {
				return
			}
			if p.fail != nil {
				yield(outboxaudit.LoggedEvent{}, p.fail)
				return
			}
		}
	}
}

func (p *producer) Lookup(ctx context.Context, ids []int64) ([]outboxaudit.LoggedEvent, error) {
	p.lookups++
	var out []outboxaudit.LoggedEvent
	for _, e := range p.events {
		if slices.Contains(ids, e.ID) {
			out = append(out, e)
		}
	}
	return out, nil
}

// consumer is an inbox in memory.
type consumer struct {
	records []inbox.RecordedMessage // any order
	fail    error
}

func (c *consumer) Recorded(ctx context.Context, since time.Time, pageSize int) iter.Seq2[inbox.RecordedMessage, error] {
	recs := slices.Clone(c.records)
	slices.SortFunc(recs, func(a, b inbox.RecordedMessage) int { return strings.Compare(a.MessageID, b.MessageID) })
	return func(yield func(inbox.RecordedMessage, error) bool) {
		if c.fail != nil {
			yield(inbox.RecordedMessage{}, c.fail)
			return
		}
		for _, r := range recs {
			if r.ProcessedAt.Before(since) {
				continue
			}
			if !yield(r, nil) {
				return
			}
		}
	}
}

// accountant keeps some events on the consumer's side; it finds them by
// their aggregate, as shipping's does (world's event i is order o-i).
type accountant struct {
	kept  map[int64]audit.Kept
	calls int
	fail  error
}

func (a *accountant) Account(ctx context.Context, events []outboxaudit.LoggedEvent) (map[int64]audit.Kept, error) {
	a.calls++
	out := map[int64]audit.Kept{}
	for _, e := range events {
		if k, ok := a.kept[e.ID]; ok && e.AggregateID == "o-"+strconv.FormatInt(e.ID, 10) {
			out[e.ID] = k
		}
	}
	return out, a.fail
}

var now = time.Date(2030, 1, 2, 12, 0, 0, 0, time.UTC)

// world holds an event in every bucket, around the window
// [now-2h, now-15m) with the default grace of 15 minutes.
func world() (*producer, *consumer, *accountant) {
	ev := func(id int64, created time.Duration, state outbox.EventState, since time.Duration) outboxaudit.LoggedEvent {
		e := outboxaudit.LoggedEvent{ID: id, AggregateID: "o-" + strconv.FormatInt(id, 10), AggregateVersion: 1,
			CreatedAt: now.Add(-created), State: state}
		if state != outbox.EventPending {
			e.Since = now.Add(-since)
		}
		return e
	}
	p := &producer{events: []outboxaudit.LoggedEvent{
		ev(1, time.Hour, outbox.EventPublished, time.Hour),           // applied
		ev(2, time.Hour, outbox.EventPublished, time.Hour),           // missing: published long ago
		ev(3, time.Hour, outbox.EventPending, 0),                     // missing: committed long ago
		ev(5, 3*time.Hour, outbox.EventPublished, 3*time.Hour),       // before the window; its record is read
		ev(9, time.Hour, outbox.EventPublished, time.Hour),           // applied
		ev(10, time.Hour, outbox.EventPublished, time.Minute),        // pending: published a minute ago
		ev(11, time.Hour, outbox.EventDeadLettered, 50*time.Minute),  // dead_lettered
		ev(12, time.Hour, outbox.EventDiscarded, 40*time.Minute),     // discarded
		ev(13, time.Hour, outbox.EventPending, 0),                    // applied: its mark is late
		ev(14, time.Hour, outbox.EventPublished, time.Hour),          // missing: its id's record is another event's
		ev(20, time.Hour, outbox.EventPublished, time.Hour),          // unrecorded
		ev(21, time.Hour, outbox.EventPublished, time.Hour),          // held
		ev(100, 5*time.Minute, outbox.EventPublished, 5*time.Minute), // after the window, applied
		ev(101, 5*time.Minute, outbox.EventPending, 0),               // after the window, not applied
	}}
	rec := func(id string, processed time.Duration) inbox.RecordedMessage {
		return inbox.RecordedMessage{MessageID: id, ProcessedAt: now.Add(-processed)}
	}
	// of is the message id event id was published under.
	of := func(id int64) string {
		for _, e := range p.events {
			if e.ID == id {
				return e.MessageID()
			}
		}
		panic("no event " + strconv.FormatInt(id, 10))
	}
	c := &consumer{records: []inbox.RecordedMessage{
		rec(of(1), time.Hour), rec(of(13), time.Hour), rec(of(100), 4*time.Minute),
		rec(of(9), time.Hour),
		rec("9", time.Hour),                                               // an outbox id without its creation time: a phantom
		rec(of(5), 119*time.Minute),                                       // event 5 was created before the window
		rec("7", time.Hour), rec("abc", time.Hour), rec("007", time.Hour), // phantoms
		// A phantom: event 14's id, from an event created 3 hours ago on a
		// primary that a failover lost.
		rec(outbox.MessageID(14, now.Add(-3*time.Hour)), time.Hour),
		rec("99", 3*time.Hour), // processed before the window: not read
	}}
	a := &accountant{kept: map[int64]audit.Kept{20: audit.KeptEffect, 21: audit.KeptHeld}}
	return p, c, a
}

func config(p *producer, c *consumer, a *accountant) audit.Config {
	cfg := audit.Config{Producer: p, Consumer: c, Since: now.Add(-2 * time.Hour), Until: now.Add(-15 * time.Minute), Now: now}
	if a != nil {
		cfg.Accountant = a
	}
	return cfg
}

func buckets(r *audit.Report) map[string]string {
	out := map[string]string{}
	for name, b := range r.Buckets() {
		if b.Count != int64(len(b.Examples)) && len(b.Examples) < audit.DefaultExamples {
			out[name] = "count " + strconv.FormatInt(b.Count, 10) + " with examples " + strings.Join(b.Examples, " ")
			continue
		}
		ex := slices.Clone(b.Examples)
		for i, id := range ex { // "13-1893582000000000" is event 13
			ex[i], _, _ = strings.Cut(id, "-")
		}
		slices.Sort(ex) // phantoms are confirmed in batches, after the others
		out[name] = strings.Join(ex, " ")
	}
	return out
}

func TestEveryEventLandsInItsBucket(t *testing.T) {
	want := map[string]string{
		"applied": "1 13 9", "missing": "14 2 3", "pending": "10", "dead_lettered": "11", "discarded": "12",
		"unrecorded": "20", "held": "21", "phantom": "007 14 7 9 abc", "applied_before_window": "5",
	}
	for _, batch := range []int{0, 1, 2} {
		p, c, a := world()
		cfg := config(p, c, a)
		cfg.LookupBatch = batch
		r, err := audit.Run(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := buckets(r); !maps.Equal(got, want) {
			t.Fatalf("look-up batch %d: buckets %v, want %v", batch, got, want)
		}
		if r.Checked != 11 || r.InboxRecords != 10 || r.Whole() {
			t.Fatalf("checked %d (want 11), inbox records %d (want 10), whole %v (want false)", r.Checked, r.InboxRecords, r.Whole())
		}
		var sum int64
		for name, b := range r.Buckets() {
			if name != "phantom" && name != "applied_before_window" {
				sum += b.Count
			}
		}
		if sum != r.Checked {
			t.Fatalf("the event buckets add up to %d, checked is %d", sum, r.Checked)
		}
		if p.lookups == 0 || a.calls == 0 {
			t.Fatalf("look-ups %d, accountant calls %d: want both asked", p.lookups, a.calls)
		}
	}
}

// Without an accountant, what the consumer kept is pending or missing.
func TestWithoutAnAccountantKeptEventsAreMissing(t *testing.T) {
	p, c, _ := world()
	r, err := audit.Run(context.Background(), config(p, c, nil))
	if err != nil {
		t.Fatal(err)
	}
	if got := buckets(r)["missing"]; got != "14 2 20 21 3" || r.Unrecorded.Count+r.Held.Count != 0 {
		t.Fatalf("missing %q, unrecorded %d, held %d: want 14 2 20 21 3, 0, 0", got, r.Unrecorded.Count, r.Held.Count)
	}
}

// A clean flow is whole; the grace decides between pending and missing.
func TestACleanFlowIsWholeAndGraceSplitsPendingFromMissing(t *testing.T) {
	p := &producer{}
	c := &consumer{}
	for id := int64(1); id <= 120; id++ {
		p.events = append(p.events, outboxaudit.LoggedEvent{ID: id, CreatedAt: now.Add(-time.Hour), State: outbox.EventPublished, Since: now.Add(-time.Hour)})
		c.records = append(c.records, inbox.RecordedMessage{MessageID: p.events[id-1].MessageID(), ProcessedAt: now.Add(-time.Hour)})
	}
	r, err := audit.Run(context.Background(), config(p, c, nil))
	if err != nil {
		t.Fatal(err)
	}
	if !r.Whole() || r.Applied.Count != 120 || r.Checked != 120 || len(r.Applied.Examples) != audit.DefaultExamples {
		t.Fatalf("clean flow: %+v", r)
	}
	// Event 121 committed 10 minutes ago, not applied: pending within the
	// grace, missing past it.
	p.events = append(p.events, outboxaudit.LoggedEvent{ID: 121, CreatedAt: now.Add(-10 * time.Minute), State: outbox.EventPending})
	for grace, bucket := range map[time.Duration]string{20 * time.Minute: "pending", 5 * time.Minute: "missing"} {
		cfg := config(p, c, nil)
		cfg.Grace, cfg.Until = grace, now
		r, err := audit.Run(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if b := r.Buckets()[bucket]; b.Count != 1 || b.Examples[0] != outbox.MessageID(121, now.Add(-10*time.Minute)) {
			t.Fatalf("grace %v: %s = %+v, want event 121", grace, bucket, b)
		}
	}
	cfg := config(p, c, nil)
	cfg.Examples = -1
	if r, err := audit.Run(context.Background(), cfg); err != nil || len(r.Applied.Examples) != 0 {
		t.Fatalf("Examples -1: %v, %v", r.Applied.Examples, err)
	}
}

func TestErrorsStopTheAudit(t *testing.T) {
	boom := errors.New("boom")
	for name, mutate := range map[string]func(*producer, *consumer, *accountant){
		"producer":   func(p *producer, _ *consumer, _ *accountant) { p.fail = boom },
		"consumer":   func(_ *producer, c *consumer, _ *accountant) { c.fail = boom },
		"accountant": func(_ *producer, _ *consumer, a *accountant) { a.fail = boom },
	} {
		p, c, a := world()
		mutate(p, c, a)
		if _, err := audit.Run(context.Background(), config(p, c, a)); !errors.Is(err, boom) {
			t.Errorf("%s fails: Run returned %v", name, err)
		}
	}
	p, c, a := world()
	for name, cfg := range map[string]audit.Config{
		"no producer":  {Consumer: c, Since: now.Add(-time.Hour), Until: now},
		"empty window": func() audit.Config { cfg := config(p, c, a); cfg.Until = cfg.Since; return cfg }(),
		"big batch": func() audit.Config {
			cfg := config(p, c, a)
			cfg.LookupBatch = outboxaudit.MaxEventLookup + 1
			return cfg
		}(),
		"negative": func() audit.Config { cfg := config(p, c, a); cfg.Grace = -time.Second; return cfg }(),
	} {
		if _, err := audit.Run(context.Background(), cfg); err == nil {
			t.Errorf("%s: want an error", name)
		}
	}
}

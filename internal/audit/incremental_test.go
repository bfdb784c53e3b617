package audit_test

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// done answers Incremental's look-ups from a consumer in memory.
type done struct {
	c     *consumer
	calls atomic.Int64
}

func (d *done) IsDone(ctx context.Context, msgID string) (bool, error) {
	d.calls.Add(1)
	for _, r := range d.c.records {
		if r.MessageID == msgID {
			return true, nil
		}
	}
	return false, nil
}

// tallies counts a consumer's records in memory, as pkg/inbox's TallyBucket
// does, per minute of the creation time their message ids carry.
type tallies struct {
	c     *consumer
	calls atomic.Int64
}

func (t *tallies) TallyBucket() time.Duration { return time.Minute }

func (t *tallies) Tallies(ctx context.Context, buckets []time.Time) ([]inbox.Tally, error) {
	t.calls.Add(1)
	out := make([]inbox.Tally, len(buckets))
	for i, b := range buckets {
		out[i].Bucket = b
		for _, r := range t.c.records {
			if _, created, err := outbox.ParseMessageID(r.MessageID); err == nil && created.Truncate(time.Minute).Equal(b) {
				out[i].Count++
				out[i].Digest = out[i].Digest.Plus(inbox.DigestOf(r.MessageID))
			}
		}
	}
	return out, nil
}

// Cycle after cycle, on a generated flow (events committed, most applied
// soon, some late, some never, some dead-lettered and replayed), each
// incremental report counts what a full audit of the same window counts,
// while it reads only the outbox's new events and looks up the open ones.
// With the inbox's tallies, the same, with fewer look-ups.
func TestIncrementalCyclesCountWhatAFullAuditCounts(t *testing.T) {
	var lookups [2]int64
	for i, withTallies := range []bool{false, true} {
		lookups[i] = incrementalCycles(t, withTallies)
	}
	if lookups[1] >= lookups[0] {
		t.Fatalf("look-ups by id: %d with tallies, %d without: want fewer", lookups[1], lookups[0])
	}
}

// incrementalCycles runs the generated flows and returns the look-ups by id.
func incrementalCycles(t *testing.T, withTallies bool) (lookups int64) {
	for seed := uint64(1); seed <= 8; seed++ {
		rng := rand.New(rand.NewPCG(seed, 4))
		p, c := &producer{}, &consumer{}
		d := &done{c: c}
		tl := &tallies{c: c}
		var tc audit.Tallies
		if withTallies {
			tc = tl
		}
		at := now.Add(-3 * time.Hour)
		id := int64(0)
		var late []outboxaudit.LoggedEvent // committed, to be applied later
		commit := func(n int) {
			for range n {
				id++
				e := outboxaudit.LoggedEvent{ID: id, CreatedAt: at.Add(-time.Duration(rng.Int64N(int64(20 * time.Second)))).Truncate(time.Microsecond), State: outbox.EventPublished}
				e.Since = e.CreatedAt.Add(time.Second)
				switch x := rng.IntN(100); {
				case x < 85:
					c.records = append(c.records, inbox.RecordedMessage{MessageID: e.MessageID(), ProcessedAt: e.Since})
				case x < 95:
					late = append(late, e)
				case x < 98:
					e.State = outbox.EventDeadLettered
				}
				p.events = append(p.events, e)
			}
			slices.SortFunc(p.events, func(a, b outboxaudit.LoggedEvent) int { return int(a.ID - b.ID) })
		}
		for at.Before(now.Add(-time.Hour)) { // the history
			commit(rng.IntN(20))
			at = at.Add(time.Minute)
		}
		inc, err := audit.NewIncremental(audit.IncrementalConfig{Config: audit.Config{Producer: p, Consumer: c}, Done: d, Tallies: tc, Lookups: 3})
		if err != nil {
			t.Fatal(err)
		}
		fulls := 0
		for cycle := range 40 {
			commit(rng.IntN(30))
			for i := 0; i < len(late); i++ {
				if rng.IntN(4) == 0 {
					c.records = append(c.records, inbox.RecordedMessage{MessageID: late[i].MessageID(), ProcessedAt: at})
					late = slices.Delete(late, i, i+1)
					i--
				}
			}
			if cycle%7 == 3 { // an operator replays the dead letters
				for i := range p.events {
					if p.events[i].State == outbox.EventDeadLettered {
						p.events[i].State = outbox.EventPublished
						late = append(late, p.events[i])
					}
				}
			}
			since, until := at.Add(-150*time.Minute), at.Add(-15*time.Minute)
			before := d.calls.Load() + tl.calls.Load()
			r, err := inc.Cycle(context.Background(), since, until, at)
			if err != nil {
				t.Fatalf("seed %d, cycle %d: %v", seed, cycle, err)
			}
			full := cycle == 0
			if cycle > 0 && d.calls.Load()+tl.calls.Load() == before {
				full = true
				fulls++
			}
			want, err := audit.Run(context.Background(), audit.Config{Producer: p, Consumer: c, Since: r.Since, Until: r.Until, Now: at})
			if err != nil {
				t.Fatal(err)
			}
			for name, b := range r.Buckets() {
				if (name == "phantom" || name == "applied_before_window") && !full {
					continue // the last full audit's
				}
				if w := want.Buckets()[name]; b.Count != w.Count {
					t.Fatalf("seed %d, cycle %d: %s %d, a full audit of [%s, %s) counts %d", seed, cycle, name, b.Count, r.Since.Format(time.TimeOnly), r.Until.Format(time.TimeOnly), w.Count)
				}
			}
			if r.Checked != want.Checked || r.Checked == 0 {
				t.Fatalf("seed %d, cycle %d: checked %d, want %d", seed, cycle, r.Checked, want.Checked)
			}
			at = at.Add(time.Minute)
		}
		if fulls > 0 {
			t.Fatalf("seed %d: %d cycles after the first were full audits", seed, fulls)
		}
		lookups += d.calls.Load()
	}
	return lookups
}

// After new events that the inbox recorded, whose buckets' tallies agree, a
// cycle looks none up by id; a bucket with an event not recorded yet has its
// open events looked up, and only that bucket's.
func TestIncrementalTrustsOnlyTalliesThatAgree(t *testing.T) {
	p, c := &producer{}, &consumer{}
	d, tl := &done{c: c}, &tallies{c: c}
	at := now.Add(-time.Hour).Truncate(time.Minute)
	add := func(n int, from time.Time, record func(i int) bool) {
		for i := range n {
			e := outboxaudit.LoggedEvent{ID: int64(len(p.events) + 1), CreatedAt: from.Add(time.Duration(i) * time.Millisecond), State: outbox.EventPublished}
			e.Since = e.CreatedAt
			p.events = append(p.events, e)
			if record(i) {
				c.records = append(c.records, inbox.RecordedMessage{MessageID: e.MessageID(), ProcessedAt: e.CreatedAt})
			}
		}
	}
	all := func(int) bool { return true }
	add(50, at.Add(-30*time.Minute), all)
	inc, err := audit.NewIncremental(audit.IncrementalConfig{Config: audit.Config{Producer: p, Consumer: c}, Done: d, Tallies: tl})
	if err != nil {
		t.Fatal(err)
	}
	cycle := func(at time.Time) *audit.Report {
		t.Helper()
		r, err := inc.Cycle(context.Background(), now.Add(-2*time.Hour), at, at)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	cycle(at)
	// Not recorded yet when the cycle reads the outbox, recorded before it
	// asks the inbox: a cycle sees both.
	add(30, at.Add(5*time.Second), func(int) bool { return false })
	c.records = nil
	for _, e := range p.events {
		c.records = append(c.records, inbox.RecordedMessage{MessageID: e.MessageID(), ProcessedAt: at})
	}
	if r := cycle(at.Add(time.Minute)); d.calls.Load() != 0 || tl.calls.Load() == 0 || r.Applied.Count != 80 || !r.Whole() {
		t.Fatalf("all recorded: %d look-ups by id, %d tally reads, applied %d: want 0, some, 80", d.calls.Load(), tl.calls.Load(), r.Applied.Count)
	}
	// Ten in the next minute, one of them not recorded but a record of
	// another event of that minute (a phantom) makes the count agree; ten
	// in the one after, all recorded.
	add(10, at.Add(time.Minute+time.Second), func(i int) bool { return i != 3 })
	c.records = append(c.records, inbox.RecordedMessage{MessageID: outbox.MessageID(999, at.Add(time.Minute+2*time.Second)), ProcessedAt: at})
	add(10, at.Add(2*time.Minute+time.Second), all)
	r := cycle(at.Add(3 * time.Minute))
	if d.calls.Load() != 10 || r.Applied.Count != 99 || r.Pending.Count != 1 {
		t.Fatalf("one not recorded: %d look-ups by id, applied %d, pending %d: want 10 (its bucket's), 99, 1", d.calls.Load(), r.Applied.Count, r.Pending.Count)
	}
	// Five more, not recorded, after the window: left for a later cycle.
	add(5, at.Add(3*time.Minute+time.Second), func(int) bool { return false })
	r, err = inc.Cycle(context.Background(), now.Add(-2*time.Hour), at.Add(3*time.Minute), at.Add(4*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if d.calls.Load() != 11 || r.Pending.Count != 1 {
		t.Fatalf("five after the window: %d look-ups by id, pending %d: want 11 (the one still open), 1", d.calls.Load(), r.Pending.Count)
	}
	r, err = inc.Cycle(context.Background(), now.Add(-2*time.Hour), at.Add(5*time.Minute), at.Add(5*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if d.calls.Load() != 17 || r.Pending.Count != 6 {
		t.Fatalf("five in the window: %d look-ups by id, pending %d: want 17, 6", d.calls.Load(), r.Pending.Count)
	}
	// A tally of the wrong width is refused.
	if _, err := audit.NewIncremental(audit.IncrementalConfig{Config: audit.Config{Producer: p, Consumer: c}, Done: d, Tallies: tl, Bucket: time.Hour}); err == nil {
		t.Fatal("Bucket an hour, tallies a minute: want an error")
	}
}

// An event the outbox had and lost (a failover) makes the cycle a full
// audit: its id may be handed out again below the watermark.
func TestIncrementalAuditsInFullAfterTheOutboxLostAnEvent(t *testing.T) {
	p, c := &producer{}, &consumer{}
	d := &done{c: c}
	for id := int64(1); id <= 50; id++ {
		e := outboxaudit.LoggedEvent{ID: id, CreatedAt: now.Add(-time.Duration(51-id) * 10 * time.Second), State: outbox.EventPublished}
		p.events = append(p.events, e)
		c.records = append(c.records, inbox.RecordedMessage{MessageID: e.MessageID(), ProcessedAt: now})
	}
	inc, err := audit.NewIncremental(audit.IncrementalConfig{Config: audit.Config{Producer: p, Consumer: c}, Done: d})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inc.Cycle(context.Background(), now.Add(-time.Hour), now, now); err != nil {
		t.Fatal(err)
	}
	// The failover loses event 50; the new primary hands id 50 out again.
	p.events[49] = outboxaudit.LoggedEvent{ID: 50, CreatedAt: now.Add(30 * time.Second), State: outbox.EventPublished}
	r, err := inc.Cycle(context.Background(), now.Add(-time.Hour), now.Add(2*time.Minute), now.Add(3*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if r.Phantom.Count != 1 || r.Missing.Count != 1 {
		t.Fatalf("after the loss: phantom %d, missing %d; want 1 and 1 (a full audit)", r.Phantom.Count, r.Missing.Count)
	}
}

// The same when the failover lost an event outright while another event of
// the last minutes, not applied yet, changed state.
func TestIncrementalAuditsInFullAfterTheOutboxLostAnEventOutright(t *testing.T) {
	p, c := &producer{}, &consumer{}
	d := &done{c: c}
	for id := int64(1); id <= 50; id++ {
		e := outboxaudit.LoggedEvent{ID: id, CreatedAt: now.Add(-time.Duration(51-id) * 10 * time.Second), State: outbox.EventPublished}
		if id == 48 {
			e.State = outbox.EventPending // not applied yet
		} else {
			c.records = append(c.records, inbox.RecordedMessage{MessageID: e.MessageID(), ProcessedAt: now})
		}
		p.events = append(p.events, e)
	}
	inc, err := audit.NewIncremental(audit.IncrementalConfig{Config: audit.Config{Producer: p, Consumer: c}, Done: d})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inc.Cycle(context.Background(), now.Add(-time.Hour), now, now); err != nil {
		t.Fatal(err)
	}
	p.events[47].State, p.events[47].Since = outbox.EventDeadLettered, now
	p.events = slices.Delete(p.events, 48, 49) // event 49, applied, lost
	r, err := inc.Cycle(context.Background(), now.Add(-time.Hour), now, now.Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if r.Phantom.Count != 1 || r.DeadLettered.Count != 1 || r.Checked != 49 {
		t.Fatalf("after the loss: phantom %d, dead-lettered %d, checked %d; want 1, 1, 49 (a full audit)", r.Phantom.Count, r.DeadLettered.Count, r.Checked)
	}
}

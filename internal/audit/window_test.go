package audit_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// An event applied long after it was published (a dead letter replayed an
// hour later) has its inbox record processed inside the window while the
// outbox, past its retention, no longer holds the event: the creation time
// its message id carries says it is older than what the outbox keeps, so it
// is no phantom. A record whose event the outbox should still hold, and does
// not, is one.
func TestRecordsOfEventsOlderThanTheWindowAreNotPhantoms(t *testing.T) {
	for seed := uint64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewPCG(seed, 37))
		since, until := now.Add(-6*time.Hour), now.Add(-45*time.Minute)
		horizon := since.Add(-time.Hour) // the outbox holds every event created from here on
		p, c := &producer{}, &consumer{}
		at := func(lo, hi time.Time) time.Time {
			return lo.Add(time.Duration(rng.Int64N(int64(hi.Sub(lo))))).Truncate(time.Microsecond)
		}
		processed := func() time.Time { return at(since, until) }
		var purged, held, phantoms int64
		id := int64(0)
		// Events created before the window, in id order: some purged (older
		// than the horizon, gone from the outbox), some still held, and
		// some the outbox should hold and does not (phantoms).
		for range 1 + rng.IntN(300) {
			id += 1 + rng.Int64N(3)
			switch rng.IntN(3) {
			case 0:
				purged++
				c.records = append(c.records, inbox.RecordedMessage{MessageID: outbox.MessageID(id, at(now.Add(-8*24*time.Hour), horizon)), ProcessedAt: processed()})
			case 1:
				held++
				e := outboxaudit.LoggedEvent{ID: id, CreatedAt: at(now.Add(-8*24*time.Hour), since), State: outbox.EventPublished}
				e.Since = e.CreatedAt
				p.events = append(p.events, e)
				c.records = append(c.records, inbox.RecordedMessage{MessageID: e.MessageID(), ProcessedAt: processed()})
			default:
				phantoms++
				c.records = append(c.records, inbox.RecordedMessage{MessageID: outbox.MessageID(id, at(horizon, until)), ProcessedAt: processed()})
			}
		}
		// The window's events, all applied.
		n := int64(1 + rng.IntN(300))
		for range n {
			id += 1 + rng.Int64N(3)
			e := outboxaudit.LoggedEvent{ID: id, CreatedAt: at(since, until), State: outbox.EventPublished}
			e.Since = e.CreatedAt
			p.events = append(p.events, e)
			c.records = append(c.records, inbox.RecordedMessage{MessageID: e.MessageID(), ProcessedAt: processed()})
		}
		r, err := audit.Run(context.Background(), audit.Config{Producer: p, Consumer: c, Since: since, Until: until, Horizon: horizon, Now: now, LookupBatch: 1 + rng.IntN(50)})
		if err != nil {
			t.Fatal(err)
		}
		if r.Phantom.Count != phantoms || r.AppliedBeforeWindow.Count != purged+held || r.Applied.Count != n || r.Checked != n || r.Missing.Count != 0 {
			t.Fatalf("seed %d: phantom %d (want %d), applied before the window %d (want %d purged + %d held), applied %d, checked %d (want %d), missing %d",
				seed, r.Phantom.Count, phantoms, r.AppliedBeforeWindow.Count, purged, held, r.Applied.Count, r.Checked, n, r.Missing.Count)
		}
	}
	// Without a horizon, the window's start is the horizon: a record of an
	// event created before it is not judged.
	p := &producer{}
	c := &consumer{records: []inbox.RecordedMessage{{MessageID: outbox.MessageID(3, now.Add(-3*time.Hour)), ProcessedAt: now.Add(-time.Hour)}}}
	r, err := audit.Run(context.Background(), config(p, c, nil))
	if err != nil {
		t.Fatal(err)
	}
	if r.Phantom.Count != 0 || r.AppliedBeforeWindow.Count != 1 {
		t.Fatalf("default horizon: phantom %d (want 0), applied before the window %d (want 1)", r.Phantom.Count, r.AppliedBeforeWindow.Count)
	}
}

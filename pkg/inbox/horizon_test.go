package inbox_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"

	"github.com/outbox-inbox/reference/pkg/inbox"
)

// An inbox deduplicates a message only while it holds the message's record.
// With MessageTime, a message older than the retention (whose record may
// have been purged) is refused instead of applied again: with 7 days of
// retention, an 8-day-old message applied when it was new, and redelivered
// after its record expired, is not applied a second time, even by a handler
// that is not idempotent by itself.
func TestAMessageOlderThanRetentionIsNotAppliedASecondTime(t *testing.T) {
	t.Parallel()
	const retention = 7 * 24 * time.Hour
	var created atomic.Int64 // the message's creation time, as its id would carry it
	b := standalone(t, inbox.Config{
		Retention: retention, DoneCacheSize: -1,
		MessageTime: func(string) (time.Time, bool) { return time.Unix(0, created.Load()), true },
	})
	ctx := t.Context()
	now := time.Now()

	created.Store(now.Add(-time.Hour).UnixNano())
	if res, err := b.in.Process(ctx, "m-1", b.applyPlain("m-1")); err != nil || res != inbox.Processed {
		t.Fatalf("first delivery: %v, %v", res, err)
	}
	// Eight days later the record is gone (retention purged it) and the
	// message comes again: a dead letter replayed, an operator's retry.
	if n, err := b.in.Purge(ctx, now.Add(retention+time.Minute)); err != nil || n != 1 {
		t.Fatalf("Purge: %d, %v; want the record purged", n, err)
	}
	created.Store(now.Add(-8 * 24 * time.Hour).UnixNano())
	res, err := b.in.Process(ctx, "m-1", b.applyPlain("m-1"))
	if !errors.Is(err, inbox.ErrBeyondHorizon) {
		t.Fatalf("8-day-old redelivery: %v, %v; want ErrBeyondHorizon", res, err)
	}
	if n, err := b.effects.CountDocuments(ctx, bson.D{{Key: "message_id", Value: "m-1"}}); err != nil || n != 1 || b.runs.Load() != 1 {
		t.Fatalf("%d effects, %d handler runs (%v); want 1 and 1", n, b.runs.Load(), err)
	}
	b.mustBeDone(t, "m-1", false) // refused: nothing recorded

	// Older than the horizon but still recorded: a duplicate, as always.
	created.Store(now.Add(-time.Hour).UnixNano())
	if _, err := b.in.Process(ctx, "m-2", b.applyPlain("m-2")); err != nil {
		t.Fatal(err)
	}
	created.Store(now.Add(-8 * 24 * time.Hour).UnixNano())
	if res, err := b.in.Process(ctx, "m-2", b.applyPlain("m-2")); err != nil || res != inbox.Duplicate {
		t.Fatalf("old duplicate still recorded: %v, %v; want Duplicate", res, err)
	}
	// An id MessageTime cannot read has no horizon.
	b2 := standalone(t, inbox.Config{Retention: retention, MessageTime: func(string) (time.Time, bool) { return time.Time{}, false }})
	if res, err := b2.in.Process(ctx, "m-3", b2.applyPlain("m-3")); err != nil || res != inbox.Processed {
		t.Fatalf("id without a time: %v, %v; want Processed", res, err)
	}
}

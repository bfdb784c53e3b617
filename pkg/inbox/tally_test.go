package inbox_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// secondsTime reads "name-unixseconds" ids.
func secondsTime(msgID string) (time.Time, bool) {
	_, s, ok := strings.Cut(msgID, "-")
	n, err := strconv.ParseInt(s, 10, 64)
	if !ok || err != nil {
		return time.Time{}, false
	}
	return time.Unix(n, 0), true
}

// Each way of recording a message done counts it once in the tally of its
// creation time's bucket, with its id's digest; a duplicate and an id
// without a time count nothing.
func TestTalliesCountEachRecordOnceInItsBucket(t *testing.T) {
	t.Parallel()
	minute := int(time.Now().Add(-time.Hour).Truncate(time.Minute).Unix()) // a bucket's start, in seconds
	ids := []string{"a-" + strconv.Itoa(minute), "b-" + strconv.Itoa(minute+59), "c-" + strconv.Itoa(minute+60)}
	for name, sa := range map[string]inbox.StandaloneConfig{
		"synchronous": {}, "buffered": {FlushInterval: 5 * time.Millisecond}, "claimed": {Lease: time.Minute},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, inboxtest.Database(t), inbox.Config{MessageTime: secondsTime, TallyBucket: time.Minute, Standalone: sa})
			ctx := t.Context()
			for _, id := range append(ids, "no-time", ids[0]) {
				if _, err := b.in.Process(ctx, id, b.apply(id)); err != nil {
					t.Fatal(err)
				}
			}
			if err := b.in.Close(ctx); err != nil {
				t.Fatal(err)
			}
			// A new Inbox, without the first one's done cache: the
			// duplicate reaches the database.
			again := setup(t, b.db, inbox.Config{MessageTime: secondsTime, TallyBucket: time.Minute})
			if _, err := again.in.Process(ctx, ids[1], func(context.Context) error { return nil }); err != nil {
				t.Fatal(err)
			}
			first := time.Unix(int64(minute), 0)
			got, err := again.in.Tallies(ctx, []time.Time{first, first.Add(time.Minute), first.Add(2 * time.Minute)})
			if err != nil {
				t.Fatal(err)
			}
			want := []inbox.Tally{
				{Bucket: first, Count: 2, Digest: inbox.DigestOf(ids[0]).Plus(inbox.DigestOf(ids[1]))},
				{Bucket: first.Add(time.Minute), Count: 1, Digest: inbox.DigestOf(ids[2])},
				{Bucket: first.Add(2 * time.Minute)},
			}
			for i := range want {
				if got[i] != want[i] {
					t.Errorf("bucket %d: %+v, want %+v", i, got[i], want[i])
				}
			}
		})
	}
	if _, err := inbox.New(inboxtest.Database(t), inbox.Config{Consumer: "x", TallyBucket: time.Minute}); err == nil {
		t.Error("TallyBucket without MessageTime: want an error")
	}
}

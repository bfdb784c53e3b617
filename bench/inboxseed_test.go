package main

import (
	"strconv"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/shipping/accounting"
)

// TestInboxSeedDocuments checks the seed's documents against pkg/inbox's
// documented schema: the records' fields, and one tally per bucket of
// creation times, _id "consumer/width/index", with the count and digest
// of the bucket's ids.
func TestInboxSeedDocuments(t *testing.T) {
	s := inboxSeedFor(inbox.Config{Consumer: "shipping", MessageTime: accounting.MessageTime, TallyBucket: time.Minute})
	base := time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)
	ids := []string{
		outbox.MessageID(1, base.Add(10*time.Second)),
		outbox.MessageID(2, base.Add(59*time.Second)),
		outbox.MessageID(3, base.Add(61*time.Second)),
		"no-time",
	}
	at := base.Add(time.Hour)
	rec := s.record(ids[0], at)
	want := bson.D{
		{Key: "_id", Value: "shipping/" + ids[0]}, {Key: "consumer", Value: "shipping"}, {Key: "message_id", Value: ids[0]},
		{Key: "state", Value: "done"}, {Key: "processed_at", Value: at}, {Key: "expire_at", Value: at.Add(inbox.DefaultRetention)},
	}
	if len(rec) != len(want) {
		t.Fatalf("record %v, want %v", rec, want)
	}
	for i := range want {
		if rec[i] != want[i] {
			t.Fatalf("record field %d: %v, want %v", i, rec[i], want[i])
		}
	}

	tallies := s.tallies(ids)
	if len(tallies) != 2 {
		t.Fatalf("%d tallies, want 2 (one per minute; the id without a time in none)", len(tallies))
	}
	first := base.UnixNano() / int64(time.Minute)
	wantTallies := []struct {
		id    string
		count int64
		sum   inbox.Digest
		start time.Time
	}{
		{"shipping/1m0s/" + strconv.FormatInt(first, 10), 2, inbox.DigestOf(ids[0]).Plus(inbox.DigestOf(ids[1])), base},
		{"shipping/1m0s/" + strconv.FormatInt(first+1, 10), 1, inbox.DigestOf(ids[2]), base.Add(time.Minute)},
	}
	for i, w := range wantTallies {
		doc := s.tallyDoc(tallies[i])
		got := map[string]any{}
		for _, e := range doc {
			got[e.Key] = e.Value
		}
		if got["_id"] != w.id || got["count"] != w.count || got["lo"] != w.sum.Lo || got["hi"] != w.sum.Hi ||
			got["bucket"] != w.start || got["expire_at"] != w.start.Add(time.Minute+inbox.DefaultRetention) {
			t.Errorf("tally %d: %v, want _id %s, count %d, digest %v, bucket %v", i, doc, w.id, w.count, w.sum, w.start)
		}
	}
}

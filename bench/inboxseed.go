package main

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
)

// inboxSeed is the only code of the benchmark that writes an inbox's
// collections without package inbox's Process: a history of done records
// whose writing through Process would take longer than the figure (about 40
// minutes for 1,000,000 on FerretDB). It writes the records and their
// tallies in the layout pkg/inbox documents as its schema (its doc.go,
// "Schema"), the digests with inbox.DigestOf, and seed checks them back
// through the package's own reads (Tallies), so a schema the package
// changes fails the figure instead of measuring another shape.
type inboxSeed struct {
	consumer    string
	retention   time.Duration
	width       time.Duration // the tallies' buckets (Config.TallyBucket)
	messageTime func(string) (time.Time, bool)
}

// inboxSeedBatch is how many records one InsertMany writes.
const inboxSeedBatch = 10_000

// seedTally is one tally document's content.
type seedTally struct {
	index int64 // the bucket's index: creation time in Unix ns / width
	count int64
	sum   inbox.Digest
}

// record is the done record of msgID processed at at, as Process writes it.
func (s inboxSeed) record(msgID string, at time.Time) bson.D {
	return bson.D{
		{Key: "_id", Value: s.consumer + "/" + msgID},
		{Key: "consumer", Value: s.consumer},
		{Key: "message_id", Value: msgID},
		{Key: "state", Value: "done"},
		{Key: "processed_at", Value: at},
		{Key: "expire_at", Value: at.Add(s.retention)},
	}
}

// tallies counts msgIDs per bucket of their creation times, in bucket
// order; an id without a time is counted in none, as the inbox does.
func (s inboxSeed) tallies(msgIDs []string) []seedTally {
	byIndex := map[int64]*seedTally{}
	for _, id := range msgIDs {
		t, ok := s.messageTime(id)
		if !ok {
			continue
		}
		k := t.UnixNano() / int64(s.width)
		st := byIndex[k]
		if st == nil {
			st = &seedTally{index: k}
			byIndex[k] = st
		}
		st.count++
		st.sum = st.sum.Plus(inbox.DigestOf(id))
	}
	out := make([]seedTally, 0, len(byIndex))
	for _, k := range slices.Sorted(maps.Keys(byIndex)) {
		out = append(out, *byIndex[k])
	}
	return out
}

// tallyDoc is the tally document of st.
func (s inboxSeed) tallyDoc(st seedTally) bson.D {
	start := s.bucketStart(st.index)
	return bson.D{
		{Key: "_id", Value: s.consumer + "/" + s.width.String() + "/" + strconv.FormatInt(st.index, 10)},
		{Key: "count", Value: st.count}, {Key: "lo", Value: st.sum.Lo}, {Key: "hi", Value: st.sum.Hi},
		{Key: "bucket", Value: start}, {Key: "expire_at", Value: start.Add(s.width + s.retention)},
	}
}

func (s inboxSeed) bucketStart(index int64) time.Time {
	return time.Unix(0, index*int64(s.width)).UTC()
}

// seed writes the done records of msgIDs, none of which the inbox holds,
// and their tallies into in's collections (in configured as s), inboxSeedBatch
// records an InsertMany, then reads every tally back through in.Tallies.
func (s inboxSeed) seed(ctx context.Context, in *inbox.Inbox, msgIDs []string) error {
	if in.TallyBucket() != s.width {
		return fmt.Errorf("seed the inbox: tallies %v wide, the inbox's %v", s.width, in.TallyBucket())
	}
	coll := in.Collection()
	docs := make([]any, 0, inboxSeedBatch)
	for i := 0; i < len(msgIDs); i += inboxSeedBatch {
		at := time.Now().UTC().Truncate(time.Millisecond)
		docs = docs[:0]
		for _, id := range msgIDs[i:min(i+inboxSeedBatch, len(msgIDs))] {
			docs = append(docs, s.record(id, at))
		}
		if _, err := coll.InsertMany(ctx, docs, options.InsertMany().SetOrdered(false)); err != nil {
			return fmt.Errorf("seed the inbox: records %d to %d: %w", i, i+len(docs), err)
		}
	}
	tallies := s.tallies(msgIDs)
	docs = docs[:0]
	for _, st := range tallies {
		docs = append(docs, s.tallyDoc(st))
	}
	if len(docs) > 0 {
		talliesColl := coll.Database().Collection(coll.Name() + inbox.TallySuffix)
		if _, err := talliesColl.InsertMany(ctx, docs, options.InsertMany().SetOrdered(false)); err != nil {
			return fmt.Errorf("seed the inbox: %d tallies: %w", len(docs), err)
		}
	}
	starts := make([]time.Time, len(tallies))
	for i, st := range tallies {
		starts[i] = s.bucketStart(st.index)
	}
	got, err := in.Tallies(ctx, starts)
	if err != nil {
		return fmt.Errorf("seed the inbox: read the tallies back: %w", err)
	}
	for i, st := range tallies {
		if got[i].Count != st.count || got[i].Digest != st.sum {
			return fmt.Errorf("seed the inbox: the tally of %v reads back as %d records (digest %v), written %d (%v): pkg/inbox's schema changed",
				starts[i], got[i].Count, got[i].Digest, st.count, st.sum)
		}
	}
	return nil
}

// inboxSeedFor is the seed of an inbox configured as cfg.
func inboxSeedFor(cfg inbox.Config) inboxSeed {
	return inboxSeed{consumer: cfg.Consumer, retention: cmp.Or(cfg.Retention, inbox.DefaultRetention),
		width: cfg.TallyBucket, messageTime: cfg.MessageTime}
}

package inbox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// Tallies. With Config.TallyBucket, the inbox counts the messages it
// records done per bucket of their creation time (Config.MessageTime), with
// a digest of their ids, in the collection <Collection>_tallies: one
// document per consumer and bucket, _id "consumer/width/index", updated
// once per write (once per flush and bucket with FlushInterval), after the
// records. A loss audit that knows what the producer committed in a bucket
// reads the bucket's tally, one look-up by _id, instead of looking each
// message up. A tally is never ahead of the records: a crash between the two
// writes leaves it short, and a claim turned done twice counts twice, so a
// tally that disagrees says "look the messages up", never that one is there.

// TallySuffix names a tally collection after the inbox's collection.
const TallySuffix = "_tallies"

// Digest is a sum of the hashes of message ids (FNV-1a, 64 bits), kept as
// the sums of their low and high 32 bits so that a database's 64-bit $inc
// never overflows. Two sets of ids with the same count and digest are the
// same set, but for a collision of the sums.
type Digest struct{ Lo, Hi int64 }

// DigestOf is the digest of one message id.
func DigestOf(msgID string) Digest {
	h := fnv.New64a()
	_, _ = h.Write([]byte(msgID))
	s := h.Sum64()
	return Digest{Lo: int64(s & 0xffffffff), Hi: int64(s >> 32)}
}

// Plus is the digest of both sets.
func (d Digest) Plus(o Digest) Digest { return Digest{d.Lo + o.Lo, d.Hi + o.Hi} }

// Minus is the digest of d's set less o's (o a subset of it).
func (d Digest) Minus(o Digest) Digest { return Digest{d.Lo - o.Lo, d.Hi - o.Hi} }

// Tally is what the inbox recorded done of the messages created in
// [Bucket, Bucket+TallyBucket): how many, and the Digest of their ids.
type Tally struct {
	Bucket time.Time
	Count  int64
	Digest Digest
}

// TallyBucket is the width of the tallies' buckets: Config.TallyBucket, 0
// when the inbox keeps none.
func (in *Inbox) TallyBucket() time.Duration { return in.tallyBucket }

func (in *Inbox) tallyID(bucket int64) string {
	return in.consumer + "/" + in.tallyBucket.String() + "/" + strconv.FormatInt(bucket, 10)
}

// tally counts msgIDs, recorded done just now, in their buckets. A failure
// is logged, not returned: the records are durable, and a short tally only
// costs the audit look-ups.
func (in *Inbox) tally(ctx context.Context, msgIDs ...string) {
	if in.tallyBucket == 0 || len(msgIDs) == 0 {
		return
	}
	type sum struct {
		n int64
		d Digest
	}
	sums := map[int64]*sum{}
	for _, id := range msgIDs {
		t, ok := in.messageTime(id)
		if !ok {
			continue
		}
		b := t.UnixNano() / int64(in.tallyBucket)
		s := sums[b]
		if s == nil {
			s = &sum{}
			sums[b] = s
		}
		s.n++
		s.d = s.d.Plus(DigestOf(id))
	}
	for b, s := range sums {
		start := time.Unix(0, b*int64(in.tallyBucket)).UTC()
		_, err := in.tallies.UpdateOne(ctx, bson.D{{Key: "_id", Value: in.tallyID(b)}}, bson.D{
			{Key: "$inc", Value: bson.D{{Key: "count", Value: s.n}, {Key: "lo", Value: s.d.Lo}, {Key: "hi", Value: s.d.Hi}}},
			{Key: "$setOnInsert", Value: bson.D{{Key: "bucket", Value: start}, {Key: "expire_at", Value: start.Add(in.tallyBucket + in.retention)}}},
		}, options.UpdateOne().SetUpsert(true))
		if err != nil {
			in.log.WarnContext(ctx, "inbox: counting recorded messages in their tally failed; an audit looks them up instead",
				"bucket", start, "records", s.n, "error", err)
		}
	}
}

// Tallies returns the tallies of the buckets starting at buckets (each a
// multiple of TallyBucket), in their order; a bucket without a tally has
// Count 0. Each is one look-up by _id, the filter FerretDB pushes down.
func (in *Inbox) Tallies(ctx context.Context, buckets []time.Time) ([]Tally, error) {
	if in.tallyBucket == 0 {
		return nil, errors.New("inbox: tallies: this inbox keeps none (Config.TallyBucket)")
	}
	out := make([]Tally, len(buckets))
	for i, start := range buckets {
		out[i].Bucket = start
		var doc struct {
			Count, Lo, Hi int64
		}
		err := in.tallies.FindOne(ctx, bson.D{{Key: "_id", Value: in.tallyID(start.UnixNano() / int64(in.tallyBucket))}}).Decode(&doc)
		if errors.Is(err, mongo.ErrNoDocuments) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("inbox: read the tally of %v: %w", start, err)
		}
		out[i].Count, out[i].Digest = doc.Count, Digest{Lo: doc.Lo, Hi: doc.Hi}
	}
	return out, nil
}

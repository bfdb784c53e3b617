package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// Server error codes EnsureIndexes handles.
const (
	codeNotImplemented        = 238
	codeIndexOptionsConflict  = 85
	codeIndexKeySpecsConflict = 86
)

// EnsureIndexes creates the index retention needs: a TTL index on expire_at
// where the server has TTL indexes, a plain one where it does not (FerretDB
// answers NotImplemented), in which case run RunPurger (or call Purge) to
// expire records. Deduplication itself needs no index: the record's _id is
// the (consumer, message id) pair. Safe to call at every start.
func (in *Inbox) EnsureIndexes(ctx context.Context) error {
	if err := in.ensureRecordIndexes(ctx); err != nil || in.tallies == nil {
		return err
	}
	// The tallies (TallyBucket) expire as the records do: by a TTL index,
	// or by Purge.
	_, err := in.tallies.Indexes().CreateOne(ctx, mongo.IndexModel{
		Keys:    bson.D{{Key: "expire_at", Value: 1}},
		Options: options.Index().SetName("expire_at_ttl").SetExpireAfterSeconds(0),
	})
	var se mongo.ServerError
	if err != nil && !(errors.As(err, &se) && (se.HasErrorCode(codeNotImplemented) || se.HasErrorCode(codeIndexOptionsConflict) || se.HasErrorCode(codeIndexKeySpecsConflict))) {
		return fmt.Errorf("inbox: create the tallies' TTL index: %w", err)
	}
	return nil
}

func (in *Inbox) ensureRecordIndexes(ctx context.Context) error {
	_, err := in.coll.Indexes().CreateOne(ctx, mongo.IndexModel{
		Keys:    bson.D{{Key: "expire_at", Value: 1}},
		Options: options.Index().SetName("expire_at_ttl").SetExpireAfterSeconds(0),
	})
	var se mongo.ServerError
	switch {
	case err == nil:
		in.ttlIndex.Store(true)
		return nil
	case errors.As(err, &se) && se.HasErrorCode(codeNotImplemented):
		// No TTL: Purge expires records. A plain index serves its delete
		// on a server that uses it (FerretDB's SQLite backend does not: see
		// Purge).
		in.ttlIndex.Store(false)
		if _, err := in.coll.Indexes().CreateOne(ctx, mongo.IndexModel{
			Keys:    bson.D{{Key: "expire_at", Value: 1}},
			Options: options.Index().SetName("expire_at"),
		}); err != nil {
			return fmt.Errorf("inbox: create expire_at index: %w", err)
		}
		in.log.InfoContext(ctx, "inbox: server has no TTL indexes, records expire through Purge", "collection", in.coll.Name())
		return nil
	case errors.As(err, &se) && (se.HasErrorCode(codeIndexOptionsConflict) || se.HasErrorCode(codeIndexKeySpecsConflict)):
		// An index on expire_at exists with other options (e.g. a plain one
		// made while the server had no TTL): keep it, and tell whether it
		// expires records.
		ttl, lerr := in.hasTTLIndex(ctx)
		if lerr != nil {
			return lerr
		}
		in.ttlIndex.Store(ttl)
		if !ttl {
			in.log.WarnContext(ctx, "inbox: a non-TTL index on expire_at exists; records expire through Purge (drop it to get a TTL index)",
				"collection", in.coll.Name())
		}
		return nil
	default:
		return fmt.Errorf("inbox: create TTL index: %w", err)
	}
}

func (in *Inbox) hasTTLIndex(ctx context.Context) (bool, error) {
	cur, err := in.coll.Indexes().List(ctx)
	if err != nil {
		return false, fmt.Errorf("inbox: list indexes: %w", err)
	}
	var specs []struct {
		Key         bson.D `bson:"key"`
		ExpireAfter *int64 `bson:"expireAfterSeconds"`
	}
	if err := cur.All(ctx, &specs); err != nil {
		return false, fmt.Errorf("inbox: list indexes: %w", err)
	}
	for _, s := range specs {
		if len(s.Key) == 1 && s.Key[0].Key == "expire_at" && s.ExpireAfter != nil {
			return true, nil
		}
	}
	return false, nil
}

// TTL reports whether the server expires records on its own (known after
// EnsureIndexes).
func (in *Inbox) TTL() bool { return in.ttlIndex.Load() }

// Purge deletes the records whose retention ended at or before now, and
// returns how many it deleted, and the expired tallies (TallyBucket).
// Records of every consumer in the collection are purged. With a TTL index
// the server does this by itself.
//
// It is one DeleteMany on expire_at. On MongoDB the expire_at index serves
// it. FerretDB's SQLite backend pushes no filter but {_id: x} down to
// SQLite, so there a purge reads every record of the collection (in
// FerretDB, not in SQLite) and deletes the expired ones in one statement:
// its cost grows with the collection, not with what expired. Deleting in
// batches by _id, the filter FerretDB does push down, was measured slower
// (see BenchmarkPurge: each delete by _id is a write transaction of its
// own there, about 7ms, and a lookup waited no less meanwhile), so on
// FerretDB keep the purge interval long (an hour) and the collection
// bounded by Retention.
func (in *Inbox) Purge(ctx context.Context, now time.Time) (int64, error) {
	expired := bson.D{{Key: "expire_at", Value: bson.D{{Key: "$lte", Value: now}}}}
	res, err := in.coll.DeleteMany(ctx, expired)
	if err != nil {
		return 0, fmt.Errorf("inbox: purge expired records: %w", err)
	}
	if in.tallies != nil {
		if _, err := in.tallies.DeleteMany(ctx, expired); err != nil {
			return res.DeletedCount, fmt.Errorf("inbox: purge expired tallies: %w", err)
		}
	}
	return res.DeletedCount, nil
}

// DefaultPurgeInterval is the interval to give RunPurger unless the
// collection is small: hourly, because on FerretDB each purge reads every
// record of the collection (see Purge), however few expired. Records expire
// up to one interval late, which only keeps them a little longer than
// Retention.
const DefaultPurgeInterval = time.Hour

// RunPurger calls Purge every interval until ctx ends, unless EnsureIndexes
// found a TTL index (then it only waits for ctx). Failures are logged and
// retried at the next tick. It returns nil when ctx ends.
func (in *Inbox) RunPurger(ctx context.Context, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("inbox: purge interval %v: want a positive duration", interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if !in.TTL() {
			n, err := in.Purge(ctx, time.Now())
			switch {
			case err != nil && ctx.Err() == nil:
				in.log.WarnContext(ctx, "inbox: purge failed, retrying at next tick", "error", err)
			case n > 0:
				in.log.InfoContext(ctx, "inbox: purged expired records", "deleted", n)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

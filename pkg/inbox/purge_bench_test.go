package inbox_test

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// BenchmarkPurge measures Purge (one DeleteMany) on a collection of
// BENCH_PURGE_RECORDS records (default 20,000) of which a tenth expired,
// against deleting in batches by _id, on the server of the tests: the embedded FerretDB
// as released (whose lookups by _id scan: no index matches them), or
// TEST_MONGO_URI, e.g. this repository's `go run ./cmd/mongolocal`, whose
// FerretDB has the _id index that the inbox's lookups and Purge's deletes
// use. Besides ns/op it reports the longest IsDone lookup made meanwhile by
// another goroutine (max-lookup-ms): how long a purge holds up the hot path.
//
//	go test -run '^$' -bench Purge -benchtime 3x ./pkg/inbox/
func BenchmarkPurge(b *testing.B) {
	records, _ := strconv.Atoi(os.Getenv("BENCH_PURGE_RECORDS"))
	records = cmp.Or(records, 20000)
	expired := records / 10
	for _, v := range []struct {
		name  string
		purge func(ctx context.Context, in *inbox.Inbox, now time.Time) (int64, error)
	}{
		{"purge", func(ctx context.Context, in *inbox.Inbox, now time.Time) (int64, error) { return in.Purge(ctx, now) }},
		{"by-id-batches", func(ctx context.Context, in *inbox.Inbox, now time.Time) (int64, error) {
			// The alternative measured against it: find up to 500 expired
			// _ids, delete them by _id (the one filter FerretDB pushes
			// down), repeat until a batch comes back short.
			var deleted int64
			filter := bson.D{{Key: "expire_at", Value: bson.D{{Key: "$lte", Value: now}}}}
			find := options.Find().SetProjection(bson.D{{Key: "_id", Value: 1}}).SetLimit(500)
			for {
				cur, err := in.Collection().Find(ctx, filter, find)
				if err != nil {
					return deleted, err
				}
				var ids []struct {
					ID string `bson:"_id"`
				}
				if err := cur.All(ctx, &ids); err != nil {
					return deleted, err
				}
				if len(ids) == 0 {
					return deleted, nil
				}
				models := make([]mongo.WriteModel, len(ids))
				for i, id := range ids {
					models[i] = mongo.NewDeleteOneModel().SetFilter(bson.D{{Key: "_id", Value: id.ID}})
				}
				res, err := in.Collection().BulkWrite(ctx, models, options.BulkWrite().SetOrdered(false))
				if err != nil {
					return deleted, err
				}
				deleted += res.DeletedCount
				if len(ids) < 500 {
					return deleted, nil
				}
			}
		}},
	} {
		b.Run(fmt.Sprintf("%s/records=%d", v.name, records), func(b *testing.B) {
			ctx := b.Context()
			in, err := inbox.New(inboxtest.Database(b), inbox.Config{Consumer: "bench", DoneCacheSize: -1})
			if err != nil {
				b.Fatal(err)
			}
			if err := in.EnsureIndexes(ctx); err != nil {
				b.Fatal(err)
			}
			now := time.Now()
			insert := func(from, to int, at time.Time) {
				for start := from; start < to; start += 1000 {
					docs := make([]any, 0, 1000)
					for i := start; i < min(start+1000, to); i++ {
						docs = append(docs, bson.D{
							{Key: "_id", Value: fmt.Sprintf("bench/%d", i)}, {Key: "consumer", Value: "bench"},
							{Key: "message_id", Value: strconv.Itoa(i)}, {Key: "state", Value: "done"},
							{Key: "processed_at", Value: at}, {Key: "expire_at", Value: at.Add(time.Hour)},
						})
					}
					if _, err := in.Collection().InsertMany(ctx, docs); err != nil {
						b.Fatal(err)
					}
				}
			}
			insert(expired, records, now)             // live
			insert(0, expired, now.Add(-2*time.Hour)) // expired
			var maxLookup atomic.Int64
			b.ResetTimer()
			for range b.N {
				stop := make(chan struct{})
				var wg sync.WaitGroup
				wg.Go(func() { // the hot path, meanwhile
					for i := 0; ; i++ {
						select {
						case <-stop:
							return
						default:
						}
						start := time.Now()
						if _, err := in.IsDone(ctx, fmt.Sprint(records-1-i%100)); err != nil {
							b.Error(err)
							return
						}
						if d := time.Since(start); d.Nanoseconds() > maxLookup.Load() {
							maxLookup.Store(d.Nanoseconds())
						}
					}
				})
				n, err := v.purge(ctx, in, now)
				close(stop)
				wg.Wait()
				if err != nil || n != int64(expired) {
					b.Fatalf("purge deleted %d, %v; want %d", n, err, expired)
				}
				b.StopTimer()
				insert(0, expired, now.Add(-2*time.Hour))
				b.StartTimer()
			}
			b.ReportMetric(float64(maxLookup.Load())/1e6, "max-lookup-ms")
		})
	}
}

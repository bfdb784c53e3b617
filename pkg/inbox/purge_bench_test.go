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

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// BenchmarkPurge measures Purge on a collection of BENCH_PURGE_RECORDS
// records (default 20,000) of which a tenth expired, against the single
// DeleteMany it replaced, on the server of the tests: the embedded FerretDB
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
		{"batched", func(ctx context.Context, in *inbox.Inbox, now time.Time) (int64, error) { return in.Purge(ctx, now) }},
		{"one-delete-many", func(ctx context.Context, in *inbox.Inbox, now time.Time) (int64, error) {
			res, err := in.Collection().DeleteMany(ctx, bson.D{{Key: "expire_at", Value: bson.D{{Key: "$lte", Value: now}}}})
			if err != nil {
				return 0, err
			}
			return res.DeletedCount, nil
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

package inbox

import (
	"context"
	"fmt"
	"iter"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// DefaultRecordedPage is the page size of Recorded when given 0.
const DefaultRecordedPage = 10_000

// RecordedMessage is a message this consumer recorded as done.
type RecordedMessage struct {
	MessageID   string
	ProcessedAt time.Time
}

// Recorded yields the messages this consumer recorded as done with a
// processed_at at or after since (all of them when since is zero), in the
// byte order of their ids ("10" before "9"), for a loss audit that compares
// them with what the producer committed. Claims (Config.Standalone.Lease) and
// records still buffered in memory (Config.Standalone.FlushInterval) are not done records and
// are not yielded.
//
// It reads pageSize records per query (0: DefaultRecordedPage), keyset by
// _id: on MongoDB each page is a range of the _id index and memory holds one
// page. On FerretDB, whose SQLite backend pushes no range or sort down, each
// page reads and sorts the whole collection: give it a page size above the
// collection's size there, so one query does it all. Records written after
// the scan went past their id are not in that scan. It stops at the first
// error, which it yields, wrapped; a consumer that stops ranging early ends
// the scan.
func (in *Inbox) Recorded(ctx context.Context, since time.Time, pageSize int) iter.Seq2[RecordedMessage, error] {
	return func(yield func(RecordedMessage, error) bool) {
		if pageSize < 0 {
			yield(RecordedMessage{}, fmt.Errorf("inbox: recorded messages: page size %d: want 0 (default %d) or more", pageSize, DefaultRecordedPage))
			return
		}
		if pageSize == 0 {
			pageSize = DefaultRecordedPage
		}
		prefix := in.consumer + "/"
		// Every _id of this consumer sorts between prefix and the same
		// prefix with its '/' replaced by the next byte, '0'.
		after, end := prefix, in.consumer+"0"
		filter := bson.D{{Key: "state", Value: stateDone}}
		if !since.IsZero() {
			filter = append(filter, bson.E{Key: "processed_at", Value: bson.D{{Key: "$gte", Value: since}}})
		}
		opts := options.Find().
			SetSort(bson.D{{Key: "_id", Value: 1}}).
			SetProjection(bson.D{{Key: "_id", Value: 1}, {Key: "message_id", Value: 1}, {Key: "processed_at", Value: 1}}).
			SetLimit(int64(pageSize)).
			SetBatchSize(int32(min(pageSize, 10_000)))
		var doc struct {
			ID          string    `bson:"_id"`
			MessageID   string    `bson:"message_id"`
			ProcessedAt time.Time `bson:"processed_at"`
		}
		for {
			q := append(bson.D{{Key: "_id", Value: bson.D{{Key: "$gt", Value: after}, {Key: "$lt", Value: end}}}}, filter...)
			cur, err := in.coll.Find(ctx, q, opts)
			if err != nil {
				yield(RecordedMessage{}, fmt.Errorf("inbox: recorded messages after %q: %w", after, err))
				return
			}
			n := 0
			for cur.Next(ctx) {
				doc.ID, doc.MessageID = "", ""
				if err := cur.Decode(&doc); err != nil {
					_ = cur.Close(ctx)
					yield(RecordedMessage{}, fmt.Errorf("inbox: recorded messages: decode %q: %w", after, err))
					return
				}
				n++
				after = doc.ID
				if !yield(RecordedMessage{MessageID: doc.MessageID, ProcessedAt: doc.ProcessedAt}, nil) {
					_ = cur.Close(ctx)
					return
				}
			}
			err = cur.Err()
			_ = cur.Close(ctx)
			if err != nil {
				yield(RecordedMessage{}, fmt.Errorf("inbox: recorded messages after %q: %w", after, err))
				return
			}
			if n < pageSize {
				return
			}
		}
	}
}

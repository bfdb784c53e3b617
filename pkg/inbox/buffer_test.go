package inbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
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

// buffered is setup with an Inbox that buffers its records; it is closed
// (and must close cleanly) when the test ends.
func buffered(t *testing.T, db *mongo.Database, cfg inbox.Config) *bundle {
	t.Helper()
	b := setup(t, db, cfg)
	t.Cleanup(func() { closeInbox(t, b.in) })
	return b
}

func closeInbox(t *testing.T, in *inbox.Inbox) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 20*time.Second)
	defer cancel()
	if err := in.Close(ctx); err != nil {
		t.Errorf("Close: %v", err)
	}
}

// recordState returns the state of msgID's record in b's collection ("" if
// there is none), read from the database.
func (b *bundle) recordState(t *testing.T, msgID string) string {
	t.Helper()
	var rec struct {
		State string `bson:"state"`
	}
	err := b.in.Collection().FindOne(t.Context(), bson.D{{Key: "_id", Value: "test/" + msgID}}).Decode(&rec)
	if errors.Is(err, mongo.ErrNoDocuments) {
		return ""
	}
	if err != nil {
		t.Fatalf("read record %s: %v", msgID, err)
	}
	return rec.State
}

func (b *bundle) waitRecords(t *testing.T, want int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		n := b.records(t)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d records after 20s, want %d", n, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// logCapture is a slog.Handler keeping every record.
type logCapture struct {
	mu      sync.Mutex
	records []slog.Record
}

func (c *logCapture) Enabled(context.Context, slog.Level) bool { return true }
func (c *logCapture) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.records = append(c.records, r.Clone())
	return nil
}
func (c *logCapture) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *logCapture) WithGroup(string) slog.Handler      { return c }

// warnings returns the attributes of each warning or error logged.
func (c *logCapture) warnings() []map[string]slog.Value {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []map[string]slog.Value
	for _, r := range c.records {
		if r.Level < slog.LevelWarn {
			continue
		}
		attrs := map[string]slog.Value{"msg": slog.StringValue(r.Message)}
		r.Attrs(func(a slog.Attr) bool {
			attrs[a.Key] = a.Value
			return true
		})
		out = append(out, attrs)
	}
	return out
}

func TestBufferedRecordIsWrittenAfterProcessReturns(t *testing.T) {
	t.Parallel()
	for name, cacheSize := range map[string]int{"with cache": 0, "without cache": -1} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := inboxtest.Database(t)
			// No flush within the test: only Close writes.
			b := buffered(t, db, inbox.Config{DoneCacheSize: cacheSize, Standalone: inbox.StandaloneConfig{FlushInterval: time.Hour}})
			other, err := inbox.New(db, inbox.Config{Consumer: "test", DoneCacheSize: -1}) // reads the database only
			if err != nil {
				t.Fatal(err)
			}

			b.process(t, "m-1", inbox.Processed)
			b.exactlyOnce(t, "m-1") // the effect is durable
			if n := b.records(t); n != 0 {
				t.Fatalf("%d records right after Process, want 0 (buffered)", n)
			}
			if done, err := other.IsDone(t.Context(), "m-1"); err != nil || done {
				t.Fatalf("another Inbox sees m-1 done=%v, %v before the flush; want false", done, err)
			}
			b.mustBeDone(t, "m-1", true) // the buffered record counts
			b.process(t, "m-1", inbox.Duplicate)
			if n := b.runs.Load(); n != 1 {
				t.Fatalf("handler ran %d times, want once", n)
			}

			if err := b.in.Close(t.Context()); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if got := b.recordState(t, "m-1"); got != "done" {
				t.Fatalf("record state after Close %q, want done", got)
			}
			if done, err := other.IsDone(t.Context(), "m-1"); err != nil || !done {
				t.Fatalf("another Inbox sees m-1 done=%v, %v after Close; want true", done, err)
			}

			// After Close, records are written before Process returns.
			b.process(t, "m-2", inbox.Processed)
			if got := b.recordState(t, "m-2"); got != "done" {
				t.Fatalf("record of a message processed after Close: state %q, want done", got)
			}
		})
	}
}

func TestBufferedRecordsAreFlushedEveryIntervalAndWhenABatchIsFull(t *testing.T) {
	t.Parallel()
	t.Run("interval", func(t *testing.T) {
		t.Parallel()
		b := buffered(t, inboxtest.Database(t), inbox.Config{Standalone: inbox.StandaloneConfig{FlushInterval: 20 * time.Millisecond}})
		b.process(t, "m-1", inbox.Processed)
		b.waitRecords(t, 1)
		b.process(t, "m-2", inbox.Processed) // the flusher woke up again
		b.waitRecords(t, 2)
	})
	t.Run("batch", func(t *testing.T) {
		t.Parallel()
		const batch = 5
		b := buffered(t, inboxtest.Database(t), inbox.Config{Standalone: inbox.StandaloneConfig{FlushInterval: time.Hour, FlushBatch: batch}})
		for i := range batch - 1 {
			b.process(t, fmt.Sprintf("m-%d", i), inbox.Processed)
		}
		time.Sleep(50 * time.Millisecond)
		if n := b.records(t); n != 0 {
			t.Fatalf("%d records before a batch was full, want 0", n)
		}
		b.process(t, "m-last", inbox.Processed)
		b.waitRecords(t, batch)
	})
}

func TestBufferedConcurrentDuplicatesEndWithOneRecordAndOneEffect(t *testing.T) {
	t.Parallel()
	const (
		messages   = 40
		deliveries = 4 // copies of each message, spread over two consumer instances
	)
	db := inboxtest.Database(t)
	logs := &logCapture{}
	cfg := inbox.Config{Logger: slog.New(logs), Standalone: inbox.StandaloneConfig{FlushInterval: 5 * time.Millisecond, FlushBatch: 8}}
	b := buffered(t, db, cfg)
	// A second instance of the same consumer, on the same collection: its
	// buffer and cache are its own, so both may run the handler and both
	// flush the record (a duplicate key for one of them).
	second := buffered(t, db, cfg)
	second.effects = b.effects

	start := make(chan struct{})
	var wg sync.WaitGroup
	ids := make([]string, messages)
	for m := range messages {
		ids[m] = fmt.Sprintf("m-%d", m)
		for d := range deliveries {
			in := []*inbox.Inbox{b.in, second.in}[d%2]
			wg.Go(func() {
				<-start
				res, err := in.Process(t.Context(), ids[m], b.apply(ids[m]))
				if err != nil || (res != inbox.Processed && res != inbox.Duplicate) {
					t.Errorf("Process(%s): %v, %v", ids[m], res, err)
				}
			})
		}
	}
	close(start)
	wg.Wait()
	closeInbox(t, b.in)
	closeInbox(t, second.in)

	b.exactlyOnce(t, ids...)
	if n := b.records(t); n != messages {
		t.Fatalf("%d records, want one per message (%d)", n, messages)
	}
	for _, id := range ids {
		if got := b.recordState(t, id); got != "done" {
			t.Fatalf("record %s: state %q, want done", id, got)
		}
	}
	if w := logs.warnings(); len(w) != 0 {
		t.Fatalf("warnings logged: %v (a duplicate key is not a failure)", w)
	}
	t.Logf("%d deliveries, %d handler runs", messages*deliveries, b.runs.Load())
}

func TestBufferedRecordMeetingARecordOrAClaimIsSettled(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	logs := &logCapture{}
	b := buffered(t, db, inbox.Config{Logger: slog.New(logs), Standalone: inbox.StandaloneConfig{FlushInterval: time.Hour}})
	for _, id := range []string{"m-1", "m-2", "m-3"} {
		b.process(t, id, inbox.Processed)
	}
	// Before the flush, another instance recorded m-2 (its own run of the
	// idempotent handler), and a Lease-mode consumer left a claim on m-3.
	other, err := inbox.New(db, inbox.Config{Consumer: "test"})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := other.Process(t.Context(), "m-2", b.apply("m-2")); err != nil || res != inbox.Processed {
		t.Fatalf("other instance: %v, %v", res, err)
	}
	now := time.Now()
	if _, err := b.in.Collection().InsertOne(t.Context(), bson.D{
		{Key: "_id", Value: "test/m-3"}, {Key: "consumer", Value: "test"}, {Key: "message_id", Value: "m-3"},
		{Key: "state", Value: "processing"}, {Key: "owner", Value: "someone"},
		{Key: "lease_until", Value: now.Add(time.Minute)}, {Key: "expire_at", Value: now.Add(time.Hour)},
	}); err != nil {
		t.Fatal(err)
	}

	closeInbox(t, b.in) // the flush meets two duplicate keys
	for _, id := range []string{"m-1", "m-2", "m-3"} {
		if got := b.recordState(t, id); got != "done" {
			t.Fatalf("record %s: state %q, want done", id, got)
		}
	}
	if n := b.records(t); n != 3 {
		t.Fatalf("%d records, want 3", n)
	}
	if w := logs.warnings(); len(w) != 0 {
		t.Fatalf("warnings logged: %v", w)
	}
	b.exactlyOnce(t, "m-1", "m-2", "m-3")
}

func TestLostBufferedRecordCostsOnlyAnIdempotentRerun(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	// The consumer that will die has a client of its own.
	client, err := mongo.Connect(options.Client().ApplyURI(inboxtest.URI(t)))
	if err != nil {
		t.Fatal(err)
	}
	dying := setup(t, client.Database(db.Name()), inbox.Config{Standalone: inbox.StandaloneConfig{FlushInterval: time.Hour}})
	dying.process(t, "m-1", inbox.Processed) // acked by the consumer
	dying.exactlyOnce(t, "m-1")

	// The process dies: its connection is gone and its buffer with it. Close
	// only stops the flusher goroutine here; it cannot write the record.
	if err := client.Disconnect(t.Context()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	err = dying.in.Close(ctx)
	cancel()
	if err == nil || !strings.Contains(err.Error(), "1 buffered done records not written") {
		t.Fatalf("Close of the dead consumer: %v, want an error naming the unwritten record", err)
	}

	// The message is delivered again (e.g. the relay republished it) to a new
	// instance: no record, so the handler runs again, idempotently.
	b := buffered(t, db, inbox.Config{Standalone: inbox.StandaloneConfig{FlushInterval: 10 * time.Millisecond}})
	if n := b.records(t); n != 0 {
		t.Fatalf("%d records, want 0: the buffered record was lost", n)
	}
	b.process(t, "m-1", inbox.Processed)
	if n := b.runs.Load(); n != 1 {
		t.Fatalf("the new instance ran the handler %d times, want once", n)
	}
	b.exactlyOnce(t, "m-1")
	b.waitRecords(t, 1)
	b.process(t, "m-1", inbox.Duplicate)
	b.exactlyOnce(t, "m-1")
}

// flakyDialer dials real connections whose writes of an insert command into
// collection fail, failInserts times: the command never reaches the server,
// and the driver sees a broken connection.
type flakyDialer struct {
	net.Dialer
	collection  string
	failInserts atomic.Int64
	failed      atomic.Int64
}

func (d *flakyDialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	c, err := d.Dialer.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return &flakyConn{Conn: c, d: d}, nil
}

type flakyConn struct {
	net.Conn
	d *flakyDialer
}

func (c *flakyConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte("insert\x00")) && bytes.Contains(p, []byte(c.d.collection)) {
		for n := c.d.failInserts.Load(); n > 0; n = c.d.failInserts.Load() {
			if c.d.failInserts.CompareAndSwap(n, n-1) {
				c.d.failed.Add(1)
				_ = c.Conn.Close()
				return 0, errors.New("flaky: connection cut")
			}
		}
	}
	return c.Conn.Write(p)
}

func TestFailedFlushIsLoggedAndRetried(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	dialer := &flakyDialer{collection: "inbox_flaky"}
	client, err := mongo.Connect(options.Client().ApplyURI(inboxtest.URI(t)).
		SetDialer(dialer).SetRetryWrites(false).
		SetHeartbeatInterval(500 * time.Millisecond).SetServerSelectionTimeout(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	logs := &logCapture{}
	b := buffered(t, client.Database(db.Name()), inbox.Config{
		Collection: "inbox_flaky", Logger: slog.New(logs),
		Standalone: inbox.StandaloneConfig{FlushInterval: 20 * time.Millisecond},
	})

	dialer.failInserts.Store(1) // the first flush fails; Process itself inserts nothing there
	b.process(t, "m-1", inbox.Processed)
	b.waitRecords(t, 1)
	if n := dialer.failed.Load(); n != 1 {
		t.Fatalf("%d inserts cut, want 1", n)
	}
	w := logs.warnings()
	if len(w) != 1 {
		t.Fatalf("warnings %v, want one for the failed flush", w)
	}
	if id, attempt := w[0]["message_id"].String(), w[0]["attempt"].Int64(); id != "m-1" || attempt != 1 || w[0]["error"].String() == "" {
		t.Fatalf("warning %v, want message_id m-1, attempt 1 and the error", w[0])
	}
	if got := b.recordState(t, "m-1"); got != "done" {
		t.Fatalf("record state %q, want done", got)
	}
	b.mustBeDone(t, "m-1", true)
}

func TestCloseIsIdempotentAndANoOpWithoutBuffering(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{})
	for range 2 {
		if err := b.in.Close(t.Context()); err != nil {
			t.Fatalf("Close without FlushInterval: %v", err)
		}
	}
	b.process(t, "m-1", inbox.Processed)

	c := buffered(t, inboxtest.Database(t), inbox.Config{Standalone: inbox.StandaloneConfig{FlushInterval: time.Hour}})
	if err := c.in.Close(t.Context()); err != nil { // nothing buffered, no flusher
		t.Fatalf("Close before any Process: %v", err)
	}
	c.process(t, "m-1", inbox.Processed)
	if n := c.records(t); n != 1 {
		t.Fatalf("%d records after Process on a closed Inbox, want 1 (written synchronously)", n)
	}
	if err := c.in.Close(t.Context()); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestNewRejectsInvalidCacheAndBufferConfig(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	for name, cfg := range map[string]inbox.Config{
		"negative flush interval":             {Consumer: "c", Standalone: inbox.StandaloneConfig{FlushInterval: -time.Millisecond}},
		"flush in transaction mode":           {Consumer: "c", Mode: inbox.ModeTransaction, Standalone: inbox.StandaloneConfig{FlushInterval: time.Millisecond}},
		"flush with a lease":                  {Consumer: "c", Standalone: inbox.StandaloneConfig{Lease: time.Second, FlushInterval: time.Millisecond}},
		"flush with a lease (auto)":           {Consumer: "c", Mode: inbox.ModeAuto, Standalone: inbox.StandaloneConfig{Lease: time.Second, FlushInterval: time.Millisecond}},
		"negative flush batch":                {Consumer: "c", Standalone: inbox.StandaloneConfig{FlushInterval: time.Millisecond, FlushBatch: -1}},
		"flush batch without flush interval":  {Consumer: "c", Standalone: inbox.StandaloneConfig{FlushBatch: 10}},
		"buffer bound without flush interval": {Consumer: "c", Standalone: inbox.StandaloneConfig{MaxBufferedRecords: 10}},
		"negative buffer bound":               {Consumer: "c", Standalone: inbox.StandaloneConfig{FlushInterval: time.Millisecond, MaxBufferedRecords: -1}},
		"cache size below -1":                 {Consumer: "c", DoneCacheSize: -2},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := inbox.New(db, cfg); err == nil {
				t.Fatalf("New(%+v) succeeded, want an error", cfg)
			}
		})
	}
	for name, cfg := range map[string]inbox.Config{
		"flush in auto mode":       {Consumer: "c", Standalone: inbox.StandaloneConfig{FlushInterval: time.Millisecond}},
		"flush in standalone mode": {Consumer: "c", Mode: inbox.ModeStandalone, Standalone: inbox.StandaloneConfig{FlushInterval: time.Millisecond, FlushBatch: 10}},
		"cache disabled":           {Consumer: "c", DoneCacheSize: -1},
	} {
		t.Run(name, func(t *testing.T) {
			in, err := inbox.New(db, cfg)
			if err != nil {
				t.Fatalf("New(%+v): %v", cfg, err)
			}
			if err := in.Close(t.Context()); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestFullBufferMakesProcessWriteItsRecordAndFailWhileFlushesFail(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	const bound = 4
	logs := &logCapture{}
	b := buffered(t, db, inbox.Config{
		Logger:     slog.New(logs),
		Standalone: inbox.StandaloneConfig{FlushInterval: 5 * time.Millisecond, FlushBatch: 2, MaxBufferedRecords: bound},
	})
	// Every write of a record of consumer "test" fails: a unique index on
	// consumer, and a document holding "test" there.
	blocker := b.in.Collection()
	if _, err := blocker.Indexes().CreateOne(t.Context(), mongo.IndexModel{
		Keys: bson.D{{Key: "consumer", Value: 1}}, Options: options.Index().SetName("block").SetUnique(true),
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := blocker.InsertOne(t.Context(), bson.D{{Key: "_id", Value: "blocker"}, {Key: "consumer", Value: "test"}}); err != nil {
		t.Fatal(err)
	}

	for i := range bound {
		b.process(t, fmt.Sprintf("m-%d", i), inbox.Processed) // buffered
	}
	// The buffer is full and its flushes fail: Process writes the record
	// itself, and that fails too: an error that is not the handler's.
	res, err := b.in.Process(t.Context(), "m-full", b.apply("m-full"))
	if err == nil || errors.Is(err, inbox.ErrHandler) {
		t.Fatalf("Process with a full buffer while writes fail: %v, %v; want a database error, not ErrHandler", res, err)
	}
	if done, err := b.in.IsDone(t.Context(), "m-full"); err != nil || done {
		t.Fatalf("IsDone(m-full) = %v, %v; want false: its record was neither written nor buffered", done, err)
	}
	if len(logs.warnings()) == 0 {
		t.Fatal("no warning logged for the failed flushes")
	}

	// The database accepts records again.
	if err := blocker.Indexes().DropOne(t.Context(), "block"); err != nil {
		t.Fatal(err)
	}
	if _, err := blocker.DeleteOne(t.Context(), bson.D{{Key: "_id", Value: "blocker"}}); err != nil {
		t.Fatal(err)
	}
	b.process(t, "m-full", inbox.Processed) // the idempotent handler runs again
	b.waitRecords(t, bound+1)
	b.exactlyOnce(t, "m-0", "m-1", "m-2", "m-3", "m-full")
}

package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/readconcern"
	"go.mongodb.org/mongo-driver/v2/mongo/writeconcern"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// These tests need a replica set (TEST_MONGO_REPLSET_URI, or, in this
// repository, Docker for a container); without one they skip, saying so,
// and TestMain prints how many did not run. Their effect is deliberately NOT
// idempotent: the transaction alone must keep it to one. The same state
// machine is tested with injected driver errors, without a server, in
// txstate_test.go.

func replicaSet(t *testing.T, cfg inbox.Config) *bundle {
	t.Helper()
	return setup(t, inboxtest.ReplicaSet(t), cfg)
}

func TestTransactionModeIsDetectedAndHasTTL(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	mode, err := b.in.Mode(t.Context())
	if err != nil || mode != inbox.ModeTransaction {
		t.Fatalf("Mode = %q, %v; want %q on a replica set", mode, err, inbox.ModeTransaction)
	}
	if !b.in.TTL() {
		t.Fatal("TTL() = false after EnsureIndexes on MongoDB")
	}
}

func TestTransactionModeRedeliveriesProduceOneEffect(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	for i := range 4 {
		res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
		want := inbox.Duplicate
		if i == 0 {
			want = inbox.Processed
		}
		if err != nil || res != want {
			t.Fatalf("delivery %d: %v, %v; want %v", i+1, res, err, want)
		}
	}
	b.exactlyOnce(t, "m-1")
}

func TestTransactionModeConcurrentDuplicatesProduceOneEffect(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	const messages, deliveries = 8, 6
	start := make(chan struct{})
	var wg sync.WaitGroup
	ids := make([]string, messages)
	for m := range messages {
		ids[m] = fmt.Sprintf("m-%d", m)
		for range deliveries {
			wg.Go(func() {
				<-start
				if _, err := b.in.Process(t.Context(), ids[m], b.applyPlain(ids[m])); err != nil {
					t.Errorf("Process(%s): %v", ids[m], err)
				}
			})
		}
	}
	close(start)
	wg.Wait()
	b.exactlyOnce(t, ids...)
}

func TestTransactionModeHandlerErrorRollsBackItsWrites(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	boom := errors.New("boom")
	_, err := b.in.Process(t.Context(), "m-1", func(ctx context.Context) error {
		if err := b.applyPlain("m-1")(ctx); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, inbox.ErrHandler) || !errors.Is(err, boom) {
		t.Fatalf("Process: %v, want ErrHandler wrapping the handler's error", err)
	}
	b.exactlyOnce(t) // the write made before the error was rolled back
	b.mustBeDone(t, "m-1", false)

	res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
	if err != nil || res != inbox.Processed {
		t.Fatalf("retry: %v, %v", res, err)
	}
	b.exactlyOnce(t, "m-1")
}

func TestTransactionModeCrashAfterEffectCommitsNothing(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = b.in.Process(t.Context(), "m-1", func(ctx context.Context) error {
			if err := b.applyPlain("m-1")(ctx); err != nil {
				return err
			}
			runtime.Goexit() // dies before the commit
			return nil
		})
	}()
	<-done
	b.exactlyOnce(t)
	res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
	if err != nil || res != inbox.Processed {
		t.Fatalf("redelivery: %v, %v", res, err)
	}
	b.exactlyOnce(t, "m-1")
}

// orphan starts, on a client of its own, a transaction that inserts
// msgID's record and effect and is never committed, as a consumer that died
// inside its transaction leaves it; abort ends it, as the server does after
// transactionLifetimeLimitSeconds.
func (b *bundle) orphan(t *testing.T, msgID string) (abort func()) {
	t.Helper()
	client := inboxtest.Client(t, inboxtest.ReplicaSetURI(t))
	sess, err := client.StartSession()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.EndSession(context.WithoutCancel(t.Context())) })
	if err := sess.StartTransaction(options.Transaction().
		SetReadConcern(readconcern.Snapshot()).SetWriteConcern(writeconcern.Majority())); err != nil {
		t.Fatal(err)
	}
	sctx := mongo.NewSessionContext(t.Context(), sess)
	db := client.Database(b.db.Name())
	now := time.Now()
	if _, err := db.Collection(b.in.Collection().Name()).InsertOne(sctx, bson.D{
		{Key: "_id", Value: "test/" + msgID}, {Key: "consumer", Value: "test"}, {Key: "message_id", Value: msgID},
		{Key: "state", Value: "done"}, {Key: "processed_at", Value: now}, {Key: "expire_at", Value: now.Add(time.Hour)},
	}); err != nil {
		t.Fatalf("orphan: insert record: %v", err)
	}
	if _, err := db.Collection(b.effects.Name()).InsertOne(sctx, bson.D{{Key: "message_id", Value: msgID}}); err != nil {
		t.Fatalf("orphan: insert effect: %v", err)
	}
	return func() {
		if err := sess.AbortTransaction(context.WithoutCancel(t.Context())); err != nil {
			t.Errorf("orphan: abort: %v", err)
		}
	}
}

// retrying is a slog.Handler that closes its channel at the first log of a
// transient error being retried.
type retrying struct {
	once sync.Once
	c    chan struct{}
}

func (r *retrying) Enabled(context.Context, slog.Level) bool { return true }
func (r *retrying) Handle(_ context.Context, rec slog.Record) error {
	if strings.Contains(rec.Message, "retrying") {
		r.once.Do(func() { close(r.c) })
	}
	return nil
}
func (r *retrying) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *retrying) WithGroup(string) slog.Handler      { return r }

func TestTransactionModeOrphanedTransactionHoldingTheRecord(t *testing.T) {
	t.Parallel()
	t.Run("outlasting the budget: transient, not a handler failure", func(t *testing.T) {
		t.Parallel()
		b := replicaSet(t, inbox.Config{Transaction: inbox.TransactionConfig{RetryBudget: time.Second}})
		abort := b.orphan(t, "m-1")
		_, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
		if !errors.Is(err, inbox.ErrTransient) || errors.Is(err, inbox.ErrHandler) {
			t.Fatalf("Process while an orphan holds the record: %v; want ErrTransient, not ErrHandler", err)
		}
		if n := b.runs.Load(); n != 0 {
			t.Fatalf("handler ran %d times, want never", n)
		}
		abort()
		res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
		if err != nil || res != inbox.Processed {
			t.Fatalf("redelivery after the orphan ended: %v, %v", res, err)
		}
		b.exactlyOnce(t, "m-1")
	})
	t.Run("ending within the budget: processed", func(t *testing.T) {
		t.Parallel()
		r := &retrying{c: make(chan struct{})}
		b := replicaSet(t, inbox.Config{Logger: slog.New(r), Transaction: inbox.TransactionConfig{RetryBudget: time.Minute}})
		abort := b.orphan(t, "m-1")
		go func() {
			<-r.c // Process met the orphan's write conflict
			abort()
		}()
		res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
		if err != nil || res != inbox.Processed {
			t.Fatalf("Process: %v, %v; want Processed once the orphan was aborted", res, err)
		}
		b.exactlyOnce(t, "m-1")
	})
}

// errVersionConflict is applyVersioned's domain error.
var errVersionConflict = errors.New("version conflict")

// applyVersioned applies version of aggregate by the rules of transaction
// mode: it reads before it writes, answers an applied version with nil and
// an unexpected one with a domain error, and returns every write error.
func (b *bundle) applyVersioned(aggregate string, version int) inbox.Handler {
	return func(ctx context.Context) error {
		b.runs.Add(1)
		var doc struct {
			Version int `bson:"version"`
		}
		err := b.effects.FindOne(ctx, bson.D{{Key: "_id", Value: aggregate}}).Decode(&doc)
		if err != nil && !errors.Is(err, mongo.ErrNoDocuments) {
			return err
		}
		switch {
		case doc.Version >= version:
			return nil // applied already, its inbox record gone (expired, or written in standalone mode)
		case doc.Version != version-1:
			return fmt.Errorf("%w: %s is at version %d, the message brings %d", errVersionConflict, aggregate, doc.Version, version)
		case version == 1:
			_, err = b.effects.InsertOne(ctx, bson.D{{Key: "_id", Value: aggregate}, {Key: "version", Value: 1}})
		default:
			_, err = b.effects.UpdateOne(ctx, bson.D{{Key: "_id", Value: aggregate}, {Key: "version", Value: version - 1}},
				bson.D{{Key: "$set", Value: bson.D{{Key: "version", Value: version}}}})
		}
		return err
	}
}

func (b *bundle) version(t *testing.T, aggregate string) int {
	t.Helper()
	var doc struct {
		Version int `bson:"version"`
	}
	if err := b.effects.FindOne(t.Context(), bson.D{{Key: "_id", Value: aggregate}}).Decode(&doc); err != nil {
		t.Fatalf("read %s: %v", aggregate, err)
	}
	return doc.Version
}

func TestTransactionModeEffectWithoutRecord(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	// Version 1 of order-1 is applied, but its inbox record is gone.
	if _, err := b.effects.InsertOne(t.Context(), bson.D{{Key: "_id", Value: "order-1"}, {Key: "version", Value: 1}}); err != nil {
		t.Fatal(err)
	}
	res, err := b.in.Process(t.Context(), "m-1", b.applyVersioned("order-1", 1))
	if err != nil || res != inbox.Processed {
		t.Fatalf("late redelivery: %v, %v; want Processed (a no-op, recorded)", res, err)
	}
	b.mustBeDone(t, "m-1", true)
	if v := b.version(t, "order-1"); v != 1 {
		t.Fatalf("version %d, want 1", v)
	}

	// The pattern transaction mode cannot have: insert, and take the
	// duplicate key for "already applied". The duplicate key has aborted
	// the transaction; Process says so instead of recording anything.
	_, err = b.in.Process(t.Context(), "m-1b", func(ctx context.Context) error {
		_, err := b.effects.InsertOne(ctx, bson.D{{Key: "_id", Value: "order-1"}, {Key: "version", Value: 1}})
		if mongo.IsDuplicateKeyError(err) {
			return nil
		}
		return err
	})
	if !errors.Is(err, inbox.ErrHandler) || !strings.Contains(err.Error(), "swallowed") {
		t.Fatalf("Process with a handler swallowing a duplicate key: %v; want ErrHandler saying so", err)
	}
	b.mustBeDone(t, "m-1b", false)
}

func TestTransactionModeVersionConflict(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	if res, err := b.in.Process(t.Context(), "m-1", b.applyVersioned("order-1", 1)); err != nil || res != inbox.Processed {
		t.Fatalf("version 1: %v, %v", res, err)
	}
	_, err := b.in.Process(t.Context(), "m-3", b.applyVersioned("order-1", 3))
	if !errors.Is(err, inbox.ErrHandler) || !errors.Is(err, errVersionConflict) {
		t.Fatalf("version 3 after 1: %v; want ErrHandler wrapping the version conflict", err)
	}
	b.mustBeDone(t, "m-3", false)
	if res, err := b.in.Process(t.Context(), "m-2", b.applyVersioned("order-1", 2)); err != nil || res != inbox.Processed {
		t.Fatalf("version 2: %v, %v", res, err)
	}
	if res, err := b.in.Process(t.Context(), "m-3", b.applyVersioned("order-1", 3)); err != nil || res != inbox.Processed {
		t.Fatalf("version 3 redelivered after 2: %v, %v", res, err)
	}
	if v := b.version(t, "order-1"); v != 3 {
		t.Fatalf("version %d, want 3", v)
	}
}

// A read preference in the URI does not move transactions off the primary.
// On a single-node replica set readPreference=secondary has nowhere to go:
// any operation of a transaction that followed it would fail server
// selection.
func TestTransactionModeRunsOnThePrimaryWhateverTheURIReadPreference(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	uri := inboxtest.ReplicaSetURI(t)
	sep := "?"
	if strings.Contains(uri, "?") {
		sep = "&"
	}
	secondary := inboxtest.Client(t, uri+sep+"readPreference=secondary&serverSelectionTimeoutMS=3000")
	db := secondary.Database(b.db.Name())
	in, err := inbox.New(db, inbox.Config{Consumer: "test", DoneCacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	effects := db.Collection("effects")
	for i := range 2 {
		res, err := in.Process(t.Context(), "m-1", func(ctx context.Context) error {
			if err := effects.FindOne(ctx, bson.D{{Key: "_id", Value: "m-1"}}).Err(); !errors.Is(err, mongo.ErrNoDocuments) {
				return fmt.Errorf("read before write: %w", err)
			}
			_, err := effects.InsertOne(ctx, bson.D{{Key: "_id", Value: "m-1"}, {Key: "message_id", Value: "m-1"}})
			return err
		})
		want := inbox.Duplicate
		if i == 0 {
			want = inbox.Processed
		}
		if err != nil || res != want {
			t.Fatalf("delivery %d: %v, %v; want %v", i+1, res, err, want)
		}
	}
	if done, err := in.IsDone(t.Context(), "m-1"); err != nil || !done {
		t.Fatalf("IsDone: %v, %v; want true", done, err)
	}
	b.exactlyOnce(t, "m-1")
}

package inbox_test

import (
	"cmp"
	"context"
	"errors"
	"maps"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// Tests run on TEST_MONGO_URI (ModeStandalone: a standalone mongod or
// FerretDB; in this repository an embedded FerretDB by default), each in a
// database of its own; transaction-mode tests run on a replica set
// (TEST_MONGO_REPLSET_URI; in this repository a container when Docker is
// there) and are skipped without one; the state machine of transaction mode
// is tested without a server in txstate_test.go. Everything comes from
// internal/inboxtest, inside this package's tree and importing only the
// driver, so the package copies into another module with its tests and no
// server in its go.mod.
func TestMain(m *testing.M) { goleak.VerifyTestMain(inboxtest.Suite(m)) }

// bundle is what a test needs: an inbox and a collection of effects.
type bundle struct {
	db      *mongo.Database
	in      *inbox.Inbox
	effects *mongo.Collection
	runs    atomic.Int64 // handler invocations
}

func setup(t *testing.T, db *mongo.Database, cfg inbox.Config) *bundle {
	t.Helper()
	cfg.Consumer = cmp.Or(cfg.Consumer, "test")
	in, err := inbox.New(db, cfg)
	if err != nil {
		t.Fatalf("inbox.New: %v", err)
	}
	err = in.EnsureIndexes(t.Context())
	for try := 1; err != nil && try < 3 && strings.Contains(err.Error(), "SQLITE_BUSY"); try++ {
		// The embedded FerretDB's SQLite backend can refuse the first
		// write of a new database while other tests create theirs ("database
		// is locked", seen once in a copy's run); a MongoDB server never
		// answers this. The index is then made on the next try.
		time.Sleep(100 * time.Millisecond)
		err = in.EnsureIndexes(t.Context())
	}
	if err != nil {
		t.Fatalf("EnsureIndexes: %v", err)
	}
	return &bundle{db: db, in: in, effects: db.Collection("effects")}
}

func standalone(t *testing.T, cfg inbox.Config) *bundle {
	t.Helper()
	return setup(t, inboxtest.Database(t), cfg)
}

// apply is an idempotent effect, as ModeStandalone requires: it inserts a
// document keyed by the message id, so a second run is a duplicate-key no-op.
// (On FerretDB the unique _id is the only atomic guard: its conditional
// updates are read-modify-write without isolation.)
func (b *bundle) apply(msgID string) inbox.Handler {
	return func(ctx context.Context) error {
		b.runs.Add(1)
		_, err := b.effects.InsertOne(ctx, bson.D{{Key: "_id", Value: msgID}, {Key: "message_id", Value: msgID}})
		if mongo.IsDuplicateKeyError(err) {
			return nil
		}
		return err
	}
}

// applyPlain is NOT idempotent: every run adds a document. Only a
// transaction, or a claim that keeps duplicates out, keeps it to one.
func (b *bundle) applyPlain(msgID string) inbox.Handler {
	return func(ctx context.Context) error {
		b.runs.Add(1)
		_, err := b.effects.InsertOne(ctx, bson.D{{Key: "message_id", Value: msgID}})
		return err
	}
}

// effectCount returns how many effects each message has.
func (b *bundle) effectCount(t *testing.T) map[string]int {
	t.Helper()
	cur, err := b.effects.Find(t.Context(), bson.D{})
	if err != nil {
		t.Fatalf("read effects: %v", err)
	}
	var docs []struct {
		MessageID string `bson:"message_id"`
	}
	if err := cur.All(t.Context(), &docs); err != nil {
		t.Fatalf("read effects: %v", err)
	}
	out := map[string]int{}
	for _, d := range docs {
		out[d.MessageID]++
	}
	return out
}

// exactlyOnce fails t unless each of ids has exactly one effect and nothing
// else has any.
func (b *bundle) exactlyOnce(t *testing.T, ids ...string) {
	t.Helper()
	got := b.effectCount(t)
	want := map[string]int{}
	for _, id := range ids {
		want[id] = 1
	}
	if !maps.Equal(got, want) {
		t.Fatalf("effects per message %v, want exactly one for each of %v", got, ids)
	}
}

func (b *bundle) mustBeDone(t *testing.T, msgID string, want bool) {
	t.Helper()
	done, err := b.in.IsDone(t.Context(), msgID)
	if err != nil {
		t.Fatalf("IsDone(%s): %v", msgID, err)
	}
	if done != want {
		t.Fatalf("IsDone(%s) = %v, want %v", msgID, done, want)
	}
}

func (b *bundle) records(t *testing.T) int64 {
	t.Helper()
	n, err := b.in.Collection().CountDocuments(t.Context(), bson.D{})
	if err != nil {
		t.Fatalf("count records: %v", err)
	}
	return n
}

// processUntilSettled calls Process until it stops answering ErrInProgress,
// within a deadline.
func processUntilSettled(ctx context.Context, in *inbox.Inbox, msgID string, h inbox.Handler) (inbox.Result, error) {
	deadline := time.Now().Add(20 * time.Second)
	for {
		res, err := in.Process(ctx, msgID, h)
		if !errors.Is(err, inbox.ErrInProgress) || time.Now().After(deadline) {
			return res, err
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

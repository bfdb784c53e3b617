package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
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

// gated is an inbox with a version gate, and an effect that is blind to
// order: it appends the message to the effects in the order its handler
// runs, once per message (keyed by the message id, read first, so that it
// is right in both modes). Only the gate keeps an aggregate's effects in
// version order.
type gated struct {
	*bundle
	gate *inbox.Gate
	seq  atomic.Int64
}

func newGated(t *testing.T, db *mongo.Database, cfg inbox.Config) *gated {
	t.Helper()
	b := setup(t, db, cfg)
	g, err := inbox.NewGate(b.in, inbox.GateConfig{})
	if err != nil {
		t.Fatalf("NewGate: %v", err)
	}
	return &gated{bundle: b, gate: g}
}

// again returns another instance of the same consumer (a restarted
// process: nothing in memory), on the same database and effects.
func (g *gated) again(t *testing.T) *gated {
	t.Helper()
	in, err := inbox.New(g.db, inbox.Config{Consumer: "test", DoneCacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	gate, err := inbox.NewGate(in, inbox.GateConfig{})
	if err != nil {
		t.Fatal(err)
	}
	n := &gated{bundle: &bundle{db: g.db, in: in, effects: g.effects}, gate: gate}
	n.seq.Store(g.seq.Load() + 1000)
	return n
}

// msgID names version v of aggregate a.
func msgID(a string, v int64) string { return fmt.Sprintf("%s-v%d", a, v) }

func (g *gated) effect(id string) inbox.Handler {
	return func(ctx context.Context) error {
		g.runs.Add(1)
		err := g.effects.FindOne(ctx, bson.D{{Key: "_id", Value: id}}).Err()
		if err == nil {
			return nil
		}
		if !errors.Is(err, mongo.ErrNoDocuments) {
			return err
		}
		_, err = g.effects.InsertOne(ctx, bson.D{{Key: "_id", Value: id}, {Key: "message_id", Value: id}, {Key: "seq", Value: g.seq.Add(1)}})
		if mongo.IsDuplicateKeyError(err) && mongo.SessionFromContext(ctx) == nil {
			return nil
		}
		return err
	}
}

func (g *gated) deliver(ctx context.Context, a string, v int64) (inbox.Result, error) {
	id := msgID(a, v)
	return g.gate.Process(ctx, id, inbox.Position{Aggregate: a, Version: v}, g.effect(id))
}

// order returns the messages with an effect, in the order their effects
// were applied.
func (g *gated) order(t *testing.T) []string {
	t.Helper()
	cur, err := g.effects.Find(t.Context(), bson.D{}, options.Find().SetSort(bson.D{{Key: "seq", Value: 1}}))
	if err != nil {
		t.Fatal(err)
	}
	var docs []struct {
		ID string `bson:"_id"`
	}
	if err := cur.All(t.Context(), &docs); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range docs {
		out = append(out, d.ID)
	}
	return out
}

func gateServers(t *testing.T, run func(t *testing.T, db func(t testing.TB) *mongo.Database)) {
	t.Helper()
	t.Run("standalone", func(t *testing.T) { t.Parallel(); run(t, inboxtest.Database) })
	t.Run("transaction", func(t *testing.T) { t.Parallel(); run(t, inboxtest.ReplicaSet) })
}

// Versions delivered 2, 1, 3, each failed delivery redelivered after the
// others as a broker requeues it: the effects are 1, 2, 3. Version 2 is
// refused with a GapError naming version 1, which is not a handler failure,
// and nothing of it is recorded.
func TestGateAppliesOutOfOrderVersionsInOrder(t *testing.T) {
	t.Parallel()
	gateServers(t, func(t *testing.T, db func(t testing.TB) *mongo.Database) {
		g := newGated(t, db(t), inbox.Config{})
		ctx := t.Context()
		_, err := g.deliver(ctx, "o-1", 2)
		var gap *inbox.GapError
		if !errors.As(err, &gap) || !errors.Is(err, inbox.ErrGap) || errors.Is(err, inbox.ErrHandler) ||
			gap.Position != (inbox.Position{Aggregate: "o-1", Version: 2}) {
			t.Fatalf("version 2 first: %v; want a GapError awaiting version 1, not ErrHandler", err)
		}
		if g.runs.Load() != 0 {
			t.Fatalf("the handler ran for a version whose predecessor is missing")
		}
		g.mustBeDone(t, msgID("o-1", 2), false)

		queue := []int64{1, 3, 2}
		for deliveries := 0; len(queue) > 0; deliveries++ {
			if deliveries > 10 {
				t.Fatalf("still undelivered after 10 deliveries: %v", queue)
			}
			v := queue[0]
			queue = queue[1:]
			res, err := g.deliver(ctx, "o-1", v)
			switch {
			case errors.Is(err, inbox.ErrGap):
				queue = append(queue, v)
			case err != nil || res != inbox.Processed:
				t.Fatalf("version %d: %v, %v", v, res, err)
			}
		}
		want := []string{msgID("o-1", 1), msgID("o-1", 2), msgID("o-1", 3)}
		if got := g.order(t); !slices.Equal(got, want) {
			t.Fatalf("effects in the order %v, want %v", got, want)
		}
	})
}

// A duplicate of an applied version changes nothing: the inbox's record
// answers Duplicate; without the record (expired, or a crash before it),
// the gate answers AlreadyApplied; another message at that version is a
// ConflictError; a version below the first is refused.
func TestGateDuplicateOfAnAppliedVersionChangesNothing(t *testing.T) {
	t.Parallel()
	gateServers(t, func(t *testing.T, db func(t testing.TB) *mongo.Database) {
		g := newGated(t, db(t), inbox.Config{})
		ctx := t.Context()
		for v := int64(1); v <= 2; v++ {
			if res, err := g.deliver(ctx, "o-1", v); err != nil || res != inbox.Processed {
				t.Fatalf("version %d: %v, %v", v, res, err)
			}
		}
		if res, err := g.deliver(ctx, "o-1", 1); err != nil || res != inbox.Duplicate {
			t.Fatalf("version 1 again: %v, %v; want Duplicate", res, err)
		}
		if _, err := g.in.Collection().DeleteMany(ctx, bson.D{}); err != nil {
			t.Fatal(err)
		}
		fresh := g.again(t)
		for v := int64(1); v <= 2; v++ {
			if res, err := fresh.deliver(ctx, "o-1", v); err != nil || res != inbox.AlreadyApplied {
				t.Fatalf("version %d without its record: %v, %v; want AlreadyApplied", v, res, err)
			}
			fresh.mustBeDone(t, msgID("o-1", v), true)
		}
		if n := g.runs.Load() + fresh.runs.Load(); n != 2 {
			t.Fatalf("the handler ran %d times, want 2 (once per version)", n)
		}
		_, err := g.gate.Process(ctx, "other", inbox.Position{Aggregate: "o-1", Version: 2}, g.effect("other"))
		var conflict *inbox.ConflictError
		if !errors.As(err, &conflict) || !errors.Is(err, inbox.ErrVersionConflict) || conflict.HeldBy != msgID("o-1", 2) {
			t.Fatalf("another message at version 2: %v; want a ConflictError held by %s", err, msgID("o-1", 2))
		}
		if _, err := g.deliver(ctx, "o-1", 0); !errors.Is(err, inbox.ErrInvalidPosition) {
			t.Fatalf("version 0: %v, want ErrInvalidPosition", err)
		}
		if _, err := g.gate.Process(ctx, "m", inbox.Position{Version: 1}, g.effect("m")); !errors.Is(err, inbox.ErrInvalidPosition) {
			t.Fatalf("no aggregate: %v, want ErrInvalidPosition", err)
		}
		g.exactlyOnce(t, msgID("o-1", 1), msgID("o-1", 2))
	})
}

// The consumer dies between the effect and the gate's mark (in the
// handler, after its effect), and between the mark and the inbox's record
// (in the hook of the record step): nothing is lost, nothing is doubled,
// and the next version waits for the first until it is marked.
func TestGateCrashBetweenEffectMarkAndRecord(t *testing.T) {
	t.Parallel()
	var crashRecord atomic.Bool
	hooks := inbox.Hooks{StartStep: func(ctx context.Context, step inbox.Step, _ string) context.Context {
		if step == inbox.StepRecord && crashRecord.Load() {
			runtime.Goexit()
		}
		return ctx
	}}
	g := newGated(t, inboxtest.Database(t), inbox.Config{Hooks: hooks, DoneCacheSize: -1})
	ctx := t.Context()
	crash := func(v int64, h inbox.Handler) {
		t.Helper()
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = g.gate.Process(ctx, msgID("o-1", v), inbox.Position{Aggregate: "o-1", Version: v}, h)
			t.Error("Process returned after the simulated crash")
		}()
		<-done
	}

	// Between the effect and the mark.
	crash(1, func(ctx context.Context) error {
		if err := g.effect(msgID("o-1", 1))(ctx); err != nil {
			return err
		}
		runtime.Goexit()
		return nil
	})
	g.exactlyOnce(t, msgID("o-1", 1))
	if _, err := g.deliver(ctx, "o-1", 2); !errors.Is(err, inbox.ErrGap) {
		t.Fatalf("version 2 after a crash before version 1's mark: %v, want ErrGap", err)
	}
	if res, err := g.deliver(ctx, "o-1", 1); err != nil || res != inbox.Processed {
		t.Fatalf("version 1 redelivered: %v, %v; want Processed (the handler again, idempotently)", res, err)
	}

	// Between the mark and the record.
	crashRecord.Store(true)
	crash(2, g.effect(msgID("o-1", 2)))
	crashRecord.Store(false)
	runs := g.runs.Load()
	if res, err := g.deliver(ctx, "o-1", 2); err != nil || res != inbox.AlreadyApplied {
		t.Fatalf("version 2 redelivered: %v, %v; want AlreadyApplied", res, err)
	}
	if g.runs.Load() != runs {
		t.Fatal("the handler ran again for a version the gate had marked")
	}
	g.mustBeDone(t, msgID("o-1", 2), true)
	if res, err := g.deliver(ctx, "o-1", 3); err != nil || res != inbox.Processed {
		t.Fatalf("version 3: %v, %v", res, err)
	}
	want := []string{msgID("o-1", 1), msgID("o-1", 2), msgID("o-1", 3)}
	if got := g.order(t); !slices.Equal(got, want) {
		t.Fatalf("effects in the order %v, want %v", got, want)
	}
	g.exactlyOnce(t, want...)
}

// Consumers racing on an aggregate's versions, each retrying its gaps, and
// duplicates of each, still apply them once each, in order, on a server
// whose updates are not atomic (FerretDB): the gate inserts, never updates.
func TestGateKeepsOrderUnderConcurrentConsumers(t *testing.T) {
	t.Parallel()
	g := newGated(t, inboxtest.Database(t), inbox.Config{})
	const versions, consumers = 6, 3
	var wg sync.WaitGroup
	for c := range consumers {
		wg.Go(func() {
			order := make([]int64, versions)
			for i := range order {
				order[i] = int64(versions - i) // newest first
			}
			if c%2 == 1 {
				slices.Reverse(order)
			}
			deadline := time.Now().Add(30 * time.Second)
			for len(order) > 0 && time.Now().Before(deadline) {
				v := order[0]
				order = order[1:]
				_, err := g.deliver(t.Context(), "o-1", v)
				switch {
				case errors.Is(err, inbox.ErrGap):
					order = append(order, v)
				case err != nil:
					t.Errorf("version %d: %v", v, err)
					return
				}
			}
			if len(order) > 0 {
				t.Errorf("consumer %d: versions %v never applied", c, order)
			}
		})
	}
	wg.Wait()
	var want []string
	for v := int64(1); v <= versions; v++ {
		want = append(want, msgID("o-1", v))
	}
	if got := g.order(t); !slices.Equal(got, want) {
		t.Fatalf("effects in the order %v, want %v", got, want)
	}
	g.exactlyOnce(t, want...)
}

// Skip passes a version without an effect (an operator discarded it, or the
// gate starts on an aggregate applied before it): the next one applies.
func TestGateSkipLetsTheNextVersionApply(t *testing.T) {
	t.Parallel()
	g := newGated(t, inboxtest.Database(t), inbox.Config{})
	ctx := t.Context()
	if _, err := g.deliver(ctx, "o-1", 5); !errors.Is(err, inbox.ErrGap) {
		t.Fatalf("version 5 first: %v, want ErrGap", err)
	}
	for range 2 { // idempotent
		if err := g.gate.Skip(ctx, inbox.Position{Aggregate: "o-1", Version: 4}, "discarded"); err != nil {
			t.Fatal(err)
		}
	}
	if res, err := g.deliver(ctx, "o-1", 5); err != nil || res != inbox.Processed {
		t.Fatalf("version 5 after 4 was skipped: %v, %v", res, err)
	}
	if err := g.gate.Skip(ctx, inbox.Position{Aggregate: "o-1", Version: 5}, ""); !errors.Is(err, inbox.ErrInvalidMessageID) {
		t.Fatalf("Skip without a message id: %v", err)
	}
	g.exactlyOnce(t, msgID("o-1", 5))
}

func TestNewGateRefusesBadConfig(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{})
	for name, cfg := range map[string]inbox.GateConfig{
		"inbox's collection": {Collection: inbox.DefaultCollection},
		"bad collection":     {Collection: "a$b"},
		"negative first":     {FirstVersion: -1},
	} {
		if _, err := inbox.NewGate(b.in, cfg); err == nil {
			t.Errorf("%s: NewGate accepted %+v", name, cfg)
		}
	}
	if _, err := inbox.NewGate(nil, inbox.GateConfig{}); err == nil {
		t.Error("NewGate accepted a nil Inbox")
	}
	g, err := inbox.NewGate(b.in, inbox.GateConfig{FirstVersion: 10})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := g.Process(t.Context(), "m", inbox.Position{Aggregate: "a", Version: 10}, b.apply("m")); err != nil || res != inbox.Processed {
		t.Fatalf("the first version: %v, %v", res, err)
	}
	if _, err := g.Process(t.Context(), "n", inbox.Position{Aggregate: "a", Version: 9}, b.apply("n")); !errors.Is(err, inbox.ErrInvalidPosition) {
		t.Fatalf("below the first version: %v", err)
	}
}

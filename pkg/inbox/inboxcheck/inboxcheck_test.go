package inboxcheck_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/inboxcheck"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// The kit runs on the embedded FerretDB (ModeStandalone) here, and on a
// replica set (ModeTransaction) where one is available.
func TestMain(m *testing.M) { goleak.VerifyTestMain(inboxtest.Suite(m)) }

// database returns a fresh database on the standalone server, on a client
// with the kit's command monitor.
func database(t *testing.T) *mongo.Database {
	t.Helper()
	return monitoredClient(t, inboxtest.URI(t)).Database(inboxtest.Database(t).Name())
}

// replicaSet is database on the replica set (skipped without one).
func replicaSet(t *testing.T) *mongo.Database {
	t.Helper()
	return monitoredClient(t, inboxtest.ReplicaSetURI(t)).Database(inboxtest.ReplicaSet(t).Name())
}

func monitoredClient(t *testing.T, uri string) *mongo.Client {
	t.Helper()
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetMonitor(inboxcheck.Monitor(nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	return client
}

// effects is an effect store for the handlers below: one document per
// applied message, numbered in the order of application.
type effects struct {
	coll *mongo.Collection
	seq  atomic.Int64
}

func newEffects(db *mongo.Database) *effects { return &effects{coll: db.Collection("effects")} }

func key(m inboxcheck.Message) string { return fmt.Sprintf("%s/%d", m.AggregateID, m.Version) }

var errGap = errors.New("the previous version is not applied yet")

// keyed is the handler to copy: it reads before it writes (applied already:
// nothing to do; previous version missing: fail, to be redelivered), and
// its insert is keyed on the aggregate's version, so a concurrent copy
// takes a duplicate key (read back outside a transaction; inside one,
// returned: the transaction is aborted).
func (e *effects) keyed(m inboxcheck.Message) inbox.Handler {
	return func(ctx context.Context) error {
		err := e.coll.FindOne(ctx, bson.D{{Key: "_id", Value: key(m)}}).Err()
		if err == nil {
			return nil
		}
		if !errors.Is(err, mongo.ErrNoDocuments) {
			return err
		}
		if m.Version > 1 {
			prev := inboxcheck.Message{AggregateID: m.AggregateID, Version: m.Version - 1}
			err := e.coll.FindOne(ctx, bson.D{{Key: "_id", Value: key(prev)}}).Err()
			if errors.Is(err, mongo.ErrNoDocuments) {
				return errGap
			}
			if err != nil {
				return err
			}
		}
		_, err = e.coll.InsertOne(ctx, e.doc(m, key(m)))
		if mongo.IsDuplicateKeyError(err) && mongo.SessionFromContext(ctx) == nil {
			return nil
		}
		return err
	}
}

func (e *effects) doc(m inboxcheck.Message, id any) bson.D {
	return bson.D{{Key: "_id", Value: id}, {Key: "aggregate_id", Value: m.AggregateID}, {Key: "message_id", Value: m.ID}, {Key: "seq", Value: e.seq.Add(1)}}
}

// markFirst keeps a "done" marker of its own per message and writes it
// before the effect, in two writes: right under every redelivery the
// inbox makes, wrong when the consumer dies between the two writes (the
// redelivery finds the marker and skips the effect).
func (e *effects) markFirst(m inboxcheck.Message) inbox.Handler {
	markers := e.coll.Database().Collection("markers")
	return func(ctx context.Context) error {
		err := markers.FindOne(ctx, bson.D{{Key: "_id", Value: m.ID}}).Err()
		if err == nil {
			return nil // done, says the marker
		}
		if !errors.Is(err, mongo.ErrNoDocuments) {
			return err
		}
		if m.Version > 1 {
			prev := inboxcheck.Message{AggregateID: m.AggregateID, Version: m.Version - 1}
			if err := e.coll.FindOne(ctx, bson.D{{Key: "_id", Value: key(prev)}}).Err(); err != nil {
				return err // not yet (or lost): the message comes again
			}
		}
		if _, err := markers.InsertOne(ctx, bson.D{{Key: "_id", Value: m.ID}}); err != nil {
			return err // a concurrent copy marked it: the redelivery finds the marker
		}
		_, err = e.coll.InsertOne(ctx, e.doc(m, key(m)))
		return err
	}
}

// counter is a naive counter: one document per aggregate, {n, applied},
// and a handler that checks the applied list, then updates the document
// ($inc n, $push the message id). Idempotent one delivery at a time; two
// concurrent runs both pass the check and both update: applied twice,
// where the server's updates of one document are atomic. Where they are
// not (FerretDB), the second update can undo the first, and the double
// application may not show.
func (e *effects) counter(m inboxcheck.Message) inbox.Handler {
	counters := e.coll.Database().Collection("counters")
	return func(ctx context.Context) error {
		var doc struct {
			Applied []string `bson:"applied"`
		}
		err := counters.FindOne(ctx, bson.D{{Key: "_id", Value: m.AggregateID}}).Decode(&doc)
		if err != nil && !errors.Is(err, mongo.ErrNoDocuments) {
			return err
		}
		if slices.Contains(doc.Applied, m.ID) {
			return nil
		}
		if int64(len(doc.Applied)) != m.Version-1 {
			return errGap
		}
		_, err = counters.UpdateOne(ctx, bson.D{{Key: "_id", Value: m.AggregateID}},
			bson.D{{Key: "$inc", Value: bson.D{{Key: "n", Value: 1}}}, {Key: "$push", Value: bson.D{{Key: "applied", Value: m.ID}}}},
			options.UpdateOne().SetUpsert(true))
		return err
	}
}

func (e *effects) counted(ctx context.Context, aggregateID string) ([]string, error) {
	var doc struct {
		Applied []string `bson:"applied"`
	}
	err := e.coll.Database().Collection("counters").FindOne(ctx, bson.D{{Key: "_id", Value: aggregateID}}).Decode(&doc)
	if errors.Is(err, mongo.ErrNoDocuments) {
		return nil, nil
	}
	return doc.Applied, err
}

// checkThenInsert has the counter's race in its own check-then-act, in
// Go: it looks for its message's effect and, not finding it, adds a
// document with an id of its own. Two concurrent runs that both checked
// before either wrote add two documents, which any server keeps.
func (e *effects) checkThenInsert(m inboxcheck.Message) inbox.Handler {
	return func(ctx context.Context) error {
		err := e.coll.FindOne(ctx, bson.D{{Key: "message_id", Value: m.ID}}).Err()
		if err == nil {
			return nil
		}
		if !errors.Is(err, mongo.ErrNoDocuments) {
			return err
		}
		if m.Version > 1 {
			prev := fmt.Sprintf("%s-v%d", m.AggregateID, m.Version-1)
			if err := e.coll.FindOne(ctx, bson.D{{Key: "message_id", Value: prev}}).Err(); err != nil {
				return err
			}
		}
		_, err = e.coll.InsertOne(ctx, e.doc(m, bson.NewObjectID()))
		return err
	}
}

// plain adds a document per run: not idempotent.
func (e *effects) plain(m inboxcheck.Message) inbox.Handler {
	return func(ctx context.Context) error {
		_, err := e.coll.InsertOne(ctx, e.doc(m, bson.NewObjectID()))
		return err
	}
}

// orderBlind is keyed but does not wait for the previous version.
func (e *effects) orderBlind(m inboxcheck.Message) inbox.Handler {
	return func(ctx context.Context) error {
		_, err := e.coll.InsertOne(ctx, e.doc(m, key(m)))
		if mongo.IsDuplicateKeyError(err) {
			return nil
		}
		return err
	}
}

// gapSwallower returns nil, without applying, when the previous version is
// missing: the message is recorded, its effect never comes.
func (e *effects) gapSwallower(m inboxcheck.Message) inbox.Handler {
	h := e.keyed(m)
	return func(ctx context.Context) error {
		if err := h(ctx); !errors.Is(err, errGap) {
			return err
		}
		return nil
	}
}

// foreign is keyed, but writes with a context of its own (captured when the
// handler was made), not the one it is given.
func (e *effects) foreign(m inboxcheck.Message) inbox.Handler {
	own := context.WithoutCancel(context.Background())
	h := e.keyed(m)
	return func(ctx context.Context) error { return h(own) }
}

// insertFirst inserts, and takes a duplicate key for "already applied":
// right without transactions, wrong inside one.
func (e *effects) insertFirst(m inboxcheck.Message) inbox.Handler {
	return func(ctx context.Context) error {
		if m.Version > 1 {
			prev := inboxcheck.Message{AggregateID: m.AggregateID, Version: m.Version - 1}
			if err := e.coll.FindOne(ctx, bson.D{{Key: "_id", Value: key(prev)}}).Err(); err != nil {
				return err
			}
		}
		_, err := e.coll.InsertOne(ctx, e.doc(m, key(m)))
		if mongo.IsDuplicateKeyError(err) {
			return nil
		}
		return err
	}
}

func (e *effects) applied(ctx context.Context, aggregateID string) ([]string, error) {
	cur, err := e.coll.Find(ctx, bson.D{{Key: "aggregate_id", Value: aggregateID}}, options.Find().SetSort(bson.D{{Key: "seq", Value: 1}}))
	if err != nil {
		return nil, err
	}
	var docs []struct {
		MessageID string `bson:"message_id"`
	}
	if err := cur.All(ctx, &docs); err != nil {
		return nil, err
	}
	ids := make([]string, len(docs))
	for i, d := range docs {
		ids[i] = d.MessageID
	}
	return ids, nil
}

// subject is the check of handler, on two aggregates per scenario (one more
// than a finding needs; the default is three).
func (e *effects) subject(handler func(inboxcheck.Message) inbox.Handler) inboxcheck.Subject {
	return inboxcheck.Subject{Handler: handler, Applied: e.applied, Aggregates: 2}
}

// fakeT is the testing.TB the kit fails, to observe how.
type fakeT struct {
	testing.TB // nil: the kit calls only the methods below
	ctx        context.Context
	mu         sync.Mutex
	errors     []string
	logs       []string
	fatal      string
}

func (f *fakeT) Helper()                  {}
func (f *fakeT) Context() context.Context { return f.ctx }
func (f *fakeT) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errors = append(f.errors, fmt.Sprintf(format, args...))
}

func (f *fakeT) Logf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.logs = append(f.logs, fmt.Sprintf(format, args...))
}

func (f *fakeT) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.fatal = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}

// runFake runs the kit on s with a fake testing.TB and returns it.
func runFake(t *testing.T, db *mongo.Database, s inboxcheck.Subject) *fakeT {
	t.Helper()
	f := &fakeT{ctx: t.Context()}
	done := make(chan struct{})
	go func() {
		defer close(done)
		inboxcheck.Run(f, db, s)
	}()
	<-done
	if f.fatal != "" {
		t.Fatalf("the kit failed by itself: %s", f.fatal)
	}
	return f
}

// wantFailures fails t unless the kit reported, for each scenario named in
// want, a finding with that problem.
func wantFailures(t *testing.T, f *fakeT, want map[string]string) {
	t.Helper()
	all := strings.Join(f.errors, "\n")
	for scenario, problem := range want {
		found := false
		for _, e := range f.errors {
			if strings.HasPrefix(e, "inboxcheck: "+scenario+": ") && strings.Contains(e, ": "+problem+": ") {
				found = true
			}
		}
		if !found {
			t.Errorf("no %q finding in scenario %s; the kit reported:\n%s", problem, scenario, all)
		}
	}
}

// A handler that follows the rules passes, in each configuration of the
// standalone protocol.
func TestAHandlerThatFollowsTheRulesPasses(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]inbox.Config{
		"plain": {},
		"lease": {Standalone: inbox.StandaloneConfig{Lease: time.Minute}},
		"buffered records, no done cache, a collection of its own": {
			DoneCacheSize: -1, Collection: "records", Standalone: inbox.StandaloneConfig{FlushInterval: 10 * time.Millisecond}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := database(t)
			e := newEffects(db)
			s := e.subject(e.keyed)
			s.Inbox = cfg
			r := inboxcheck.Run(t, db, s)
			if r.Mode != inbox.ModeStandalone || r.Deliveries < 6*2*2 {
				t.Fatalf("report: %s", r)
			}
			// What only transactions show is said to be unchecked, not passed.
			for _, sc := range []string{"crash_window", "expired_record"} {
				if !slices.ContainsFunc(r.Unchecked, func(u inboxcheck.Unchecked) bool { return u.Scenario == sc }) {
					t.Errorf("standalone mode, and %s is not listed as unchecked:\n%s", sc, r)
				}
			}
		})
	}
}

// A deliberately non-idempotent handler fails: the inbox keeps redeliveries
// of a recorded message away from it, but not the crash window, a
// concurrent duplicate, or a redelivery after retention; and it applies
// versions in the order they come.
func TestANonIdempotentHandlerFails(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	f := runFake(t, db, e.subject(e.plain))
	wantFailures(t, f, map[string]string{
		"crash_window":   inboxcheck.AppliedTwice,
		"concurrent":     inboxcheck.AppliedTwice,
		"expired_record": inboxcheck.AppliedTwice,
		"out_of_order":   inboxcheck.OutOfOrder,
	})
	for _, e := range f.errors {
		if strings.HasPrefix(e, "inboxcheck: redelivered: ") || strings.HasPrefix(e, "inboxcheck: foreign_context: ") {
			t.Errorf("a finding the inbox or the handler's use of its context rules out: %s", e)
		}
	}
}

// A handler that marks a message done itself and then applies its effect,
// in two writes, passes every redelivery, the crash between effect and
// record, and concurrency: only a crash between its own two writes loses
// the effect.
func TestAMarkFirstHandlerLosesTheEffectWhenItDiesBetweenItsWrites(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	s := e.subject(e.markFirst)
	s.MaxDeliveries = 3
	f := runFake(t, db, s)
	wantFailures(t, f, map[string]string{"crash_inside": inboxcheck.Lost})
	for _, e := range f.errors {
		if !strings.HasPrefix(e, "inboxcheck: crash_inside: ") {
			t.Errorf("a finding outside crash_inside: %s", e)
		}
	}
}

// The handler to copy survives a crash after any of its commands.
func TestAKeyedHandlerSurvivesACrashAfterAnyCommand(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	s := e.subject(e.keyed)
	s.Versions = 3
	r := inboxcheck.Run(t, db, s)
	// Version 3 makes three commands: the crash after the third is the
	// crash window; one more pass sees no crash point reached.
	if got := r.Crashes; got < 3 {
		t.Errorf("crash points tried: %d, want at least 3; report:\n%s", got, r)
	}
}

// A naive counter fails where the server can show its race; where it
// cannot (concurrent updates of one document not atomic, as on FerretDB),
// the report says concurrent was not checkable instead of passing it.
func TestANaiveCounterFailsOrConcurrentIsUnchecked(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	s := inboxcheck.Subject{Handler: e.counter, Applied: e.counted, Aggregates: 3}
	f := &fakeT{ctx: t.Context()}
	var r *inboxcheck.Report
	done := make(chan struct{})
	go func() {
		defer close(done)
		r = inboxcheck.Run(f, db, s)
	}()
	<-done
	if f.fatal != "" {
		t.Fatal(f.fatal)
	}
	unchecked := slices.ContainsFunc(r.Unchecked, func(u inboxcheck.Unchecked) bool { return u.Scenario == "concurrent" })
	if ferret(t, db) && !unchecked {
		t.Errorf("on FerretDB concurrent is not listed as unchecked:\n%s", r)
	}
	if !unchecked {
		wantFailures(t, f, map[string]string{"concurrent": inboxcheck.AppliedTwice})
	}
	if unchecked && !slices.ContainsFunc(f.logs, func(l string) bool {
		return strings.HasPrefix(l, "inboxcheck: concurrent: not checkable on this server: concurrent updates of one document are not atomic here")
	}) {
		t.Errorf("Run did not say concurrent was not checkable; it logged:\n%s", strings.Join(f.logs, "\n"))
	}
	for _, e := range f.errors {
		if !strings.HasPrefix(e, "inboxcheck: concurrent: ") {
			t.Errorf("a finding outside concurrent: %s", e)
		}
	}
}

// The same race in a handler that adds a document per run is caught on
// any server: the kit makes the two runs meet as they enter the handler,
// so both check before either writes.
func TestACheckThenInsertRaceFailsOnAnyServer(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	f := runFake(t, db, e.subject(e.checkThenInsert))
	wantFailures(t, f, map[string]string{"concurrent": inboxcheck.AppliedTwice})
	n := 0
	for _, e := range f.errors {
		if strings.HasPrefix(e, "inboxcheck: concurrent: ") {
			n++
		} else {
			t.Errorf("a finding outside concurrent: %s", e)
		}
	}
	// The race is the scheduler's: most messages lose it, not always all
	// four (2 aggregates x 2 versions); one is enough to fail the subject.
	if n < 1 || n > 4 {
		t.Errorf("%d concurrent findings, want 1 to 4 (one per message that lost the race):\n%s", n, strings.Join(f.errors, "\n"))
	}
}

// ferret reports whether db is on FerretDB (its buildInfo says so).
func ferret(t *testing.T, db *mongo.Database) bool {
	t.Helper()
	info, err := db.RunCommand(t.Context(), bson.D{{Key: "buildInfo", Value: 1}}).Raw()
	if err != nil {
		t.Fatal(err)
	}
	_, err = info.LookupErr("ferretdbVersion")
	return err == nil
}

func TestAnOrderBlindHandlerFails(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	f := runFake(t, db, e.subject(e.orderBlind))
	wantFailures(t, f, map[string]string{"out_of_order": inboxcheck.OutOfOrder, "shuffled": inboxcheck.OutOfOrder})
	if len(f.errors) != 4 {
		t.Errorf("want one finding per aggregate of out_of_order and of shuffled, got:\n%s", strings.Join(f.errors, "\n"))
	}
}

// The same order-blind handler behind the inbox's version gate passes every
// scenario, out of order ones included.
func TestAnOrderBlindHandlerBehindTheGatePasses(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	s := e.subject(e.orderBlind)
	s.Versions = 3
	s.Gate = func(in *inbox.Inbox) (inboxcheck.Gate, error) { return inbox.NewGate(in, inbox.GateConfig{}) }
	r := inboxcheck.Run(t, db, s)
	if !r.Gated || !strings.Contains(r.String(), "through a version gate") {
		t.Errorf("report: %s", r)
	}
}

// leakyGate is a gate that lets every version through (the inbox alone):
// what a gate whose predecessor check is broken does.
type leakyGate struct{ in *inbox.Inbox }

func (g leakyGate) Process(ctx context.Context, msgID string, _ inbox.Position, h inbox.Handler) (inbox.Result, error) {
	return g.in.Process(ctx, msgID, h)
}

// A gate that lets a version through before its predecessor fails the
// scenarios that deliver out of order.
func TestAGateThatLetsAVersionPassItsPredecessorFails(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	s := e.subject(e.orderBlind)
	s.Gate = func(in *inbox.Inbox) (inboxcheck.Gate, error) { return leakyGate{in}, nil }
	f := runFake(t, db, s)
	wantFailures(t, f, map[string]string{"out_of_order": inboxcheck.OutOfOrder, "shuffled": inboxcheck.OutOfOrder})
}

// The same handler on a subject that declares its effect order-insensitive
// (a set of facts) passes: versions applied in any order, each once.
func TestAnOrderInsensitiveSubjectGetsNoOrderFindings(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	s := e.subject(e.orderBlind)
	s.OrderInsensitive = true
	f := runFake(t, db, s)
	if len(f.errors) != 0 {
		t.Errorf("findings on an order-insensitive subject:\n%s", strings.Join(f.errors, "\n"))
	}
	// Order-insensitive is not "anything goes": an effect applied twice is
	// still a finding.
	s = e.subject(e.plain)
	s.OrderInsensitive = true
	f = runFake(t, db, s)
	wantFailures(t, f, map[string]string{"expired_record": inboxcheck.AppliedTwice})
	for _, e := range f.errors {
		if strings.Contains(e, ": "+inboxcheck.OutOfOrder+": ") {
			t.Errorf("an order finding on an order-insensitive subject: %s", e)
		}
	}
}

func TestAHandlerThatSwallowsAGapLosesTheEffect(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	f := runFake(t, db, e.subject(e.gapSwallower))
	wantFailures(t, f, map[string]string{"out_of_order": inboxcheck.Lost})
}

// A handler that writes with a context other than the one it is given is
// caught even without transactions.
func TestAHandlerWritingWithAnotherContextIsCaught(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	f := runFake(t, db, e.subject(e.foreign))
	wantFailures(t, f, map[string]string{"foreign_context": inboxcheck.ForeignContext})
	for _, e := range f.errors {
		if !strings.HasPrefix(e, "inboxcheck: foreign_context: ") {
			t.Errorf("a finding outside foreign_context: %s", e)
		}
	}
}

func TestAHandlerThatAlwaysFailsIsNeverAcknowledged(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	s := e.subject(func(inboxcheck.Message) inbox.Handler {
		return func(context.Context) error { return errors.New("schema registry down") }
	})
	s.MaxDeliveries, s.Aggregates, s.Versions = 3, 1, 1
	f := runFake(t, db, s)
	wantFailures(t, f, map[string]string{"redelivered": inboxcheck.NeverAcknowledged, "expired_record": inboxcheck.Lost})
	if !strings.Contains(strings.Join(f.errors, "\n"), "3 deliveries failed, the last with: inbox: handler failed: schema registry down") {
		t.Errorf("the finding does not say why:\n%s", strings.Join(f.errors, "\n"))
	}
}

func TestABadSubjectIsTheKitsOwnError(t *testing.T) {
	t.Parallel()
	db := database(t)
	e := newEffects(db)
	for name, s := range map[string]inboxcheck.Subject{
		"no handler":     {Applied: e.applied},
		"no applied":     {Handler: e.keyed},
		"negative":       {Handler: e.keyed, Applied: e.applied, Versions: -1},
		"invalid config": {Handler: e.keyed, Applied: e.applied, Inbox: inbox.Config{Standalone: inbox.StandaloneConfig{Lease: -time.Second}}},
	} {
		if r, err := inboxcheck.Check(t.Context(), db, s); err == nil {
			t.Errorf("%s: no error, report %v", name, r)
		}
	}
	if _, err := inboxcheck.Check(t.Context(), nil, e.subject(e.keyed)); err == nil {
		t.Error("nil database: no error")
	}
	// A client without the kit's monitor could not crash the handler
	// inside: that is the kit's error, not a pass.
	if r, err := inboxcheck.Check(t.Context(), inboxtest.Database(t), e.subject(e.keyed)); err == nil || !strings.Contains(err.Error(), "inboxcheck.Monitor") {
		t.Errorf("no monitor: error %v, report %v", err, r)
	}
}

// In transaction mode the rules are stricter, and the kit checks them: a
// handler that takes a duplicate key for "already applied" breaks the
// transaction when the effect is there without a record.
func TestTransactionModeRules(t *testing.T) {
	t.Parallel()
	db := replicaSet(t)
	e := newEffects(db)
	r := inboxcheck.Run(t, db, e.subject(e.keyed))
	if r.Mode != inbox.ModeTransaction {
		t.Fatalf("mode %s, want %s", r.Mode, inbox.ModeTransaction)
	}
	if len(r.Unchecked) != 0 {
		t.Errorf("unchecked on a replica set:\n%s", r)
	}
	s := e.subject(e.insertFirst)
	s.MaxDeliveries = 3
	wantFailures(t, runFake(t, db, s), map[string]string{"expired_record": inboxcheck.NeverAcknowledged})
	wantFailures(t, runFake(t, db, e.subject(e.foreign)), map[string]string{"foreign_context": inboxcheck.ForeignContext})
}

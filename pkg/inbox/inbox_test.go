package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/event"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// standaloneVariants are the two ModeStandalone protocols: without a claim,
// and with a claim (Lease).
var standaloneVariants = []struct {
	name string
	cfg  inbox.Config
}{
	{"no claim", inbox.Config{}},
	{"claim", inbox.Config{Standalone: inbox.StandaloneConfig{Lease: time.Minute}}}, // no takeover within a test
}

func TestAutoModeIsStandaloneOnFerretDB(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{})
	mode, err := b.in.Mode(t.Context())
	if err != nil || mode != inbox.ModeStandalone {
		t.Fatalf("Mode = %q, %v; want %q", mode, err, inbox.ModeStandalone)
	}
	if b.in.TTL() {
		t.Fatal("TTL() = true on FerretDB, which has no TTL indexes")
	}
}

func TestRedeliveriesProduceOneEffect(t *testing.T) {
	t.Parallel()
	for _, v := range standaloneVariants {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			b := standalone(t, v.cfg)
			for i := range 5 {
				res, err := b.in.Process(t.Context(), "m-1", b.apply("m-1"))
				want := inbox.Duplicate
				if i == 0 {
					want = inbox.Processed
				}
				if err != nil || res != want {
					t.Fatalf("delivery %d: %v, %v; want %v", i+1, res, err, want)
				}
			}
			if n := b.runs.Load(); n != 1 {
				t.Errorf("handler ran %d times, want once (duplicates are skipped)", n)
			}
			b.exactlyOnce(t, "m-1")
			b.mustBeDone(t, "m-1", true)
		})
	}
}

func TestConcurrentDuplicatesProduceOneEffect(t *testing.T) {
	t.Parallel()
	const (
		messages   = 10
		deliveries = 6 // copies of each message, all in flight at once
	)
	for _, v := range standaloneVariants {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			b := standalone(t, v.cfg)
			start := make(chan struct{})
			var (
				wg      sync.WaitGroup
				mu      sync.Mutex
				results = map[string][]inbox.Result{}
			)
			for m := range messages {
				id := fmt.Sprintf("m-%d", m)
				for range deliveries {
					wg.Go(func() {
						<-start
						res, err := processUntilSettled(t.Context(), b.in, id, b.apply(id))
						if err != nil {
							t.Errorf("Process(%s): %v", id, err)
							return
						}
						mu.Lock()
						results[id] = append(results[id], res)
						mu.Unlock()
					})
				}
			}
			close(start)
			wg.Wait()

			ids := make([]string, 0, messages)
			for id := range results {
				ids = append(ids, id)
			}
			b.exactlyOnce(t, ids...)
			for id, rs := range results {
				if len(rs) != deliveries {
					t.Errorf("%s: %d results, want %d", id, len(rs), deliveries)
				}
				b.mustBeDone(t, id, true)
			}
			if n := b.records(t); n != messages {
				t.Errorf("%d inbox records, want %d", n, messages)
			}
			if v.cfg.Standalone.Lease > 0 && b.runs.Load() != messages {
				t.Errorf("with a claim the handler ran %d times, want once per message (%d)", b.runs.Load(), messages)
			}
			t.Logf("%d deliveries, %d handler runs", messages*deliveries, b.runs.Load())
		})
	}
}

// crashAfterEffect runs one delivery whose process "dies" right after the
// handler's effect: the goroutine exits on the spot (runtime.Goexit), so
// nothing of Process after the handler runs, like a SIGKILL.
func crashAfterEffect(t *testing.T, b *bundle, msgID string) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = b.in.Process(t.Context(), msgID, func(ctx context.Context) error {
			if err := b.apply(msgID)(ctx); err != nil {
				t.Errorf("effect: %v", err)
				return err
			}
			runtime.Goexit()
			return nil
		})
		t.Error("Process returned after the simulated crash")
	}()
	<-done
}

func TestCrashBetweenEffectAndRecordStillOneEffect(t *testing.T) {
	t.Parallel()
	for _, v := range []struct {
		name string
		cfg  inbox.Config
	}{
		{"no claim", inbox.Config{}},
		{"claim", inbox.Config{Standalone: inbox.StandaloneConfig{Lease: 300 * time.Millisecond}}},
	} {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			b := standalone(t, v.cfg)
			crashAfterEffect(t, b, "m-1")
			b.exactlyOnce(t, "m-1") // the crashed delivery's effect is there
			b.mustBeDone(t, "m-1", false)

			// The broker redelivers. With a claim, the redelivery waits for
			// the dead claimer's lease to run out.
			res, err := processUntilSettled(t.Context(), b.in, "m-1", b.apply("m-1"))
			if err != nil || res != inbox.Processed {
				t.Fatalf("redelivery: %v, %v; want Processed", res, err)
			}
			b.exactlyOnce(t, "m-1")
			if n := b.runs.Load(); n != 2 {
				t.Errorf("handler ran %d times, want 2 (the redelivery re-runs it, idempotently)", n)
			}
			b.mustBeDone(t, "m-1", true)

			res, err = b.in.Process(t.Context(), "m-1", b.apply("m-1"))
			if err != nil || res != inbox.Duplicate {
				t.Fatalf("third delivery: %v, %v; want Duplicate", res, err)
			}
		})
	}
}

func TestConcurrentDuplicateWaitsForALiveClaim(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{Standalone: inbox.StandaloneConfig{Lease: time.Minute}})
	entered, release := make(chan struct{}), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		res, err := b.in.Process(t.Context(), "m-1", func(ctx context.Context) error {
			close(entered)
			<-release
			return b.apply("m-1")(ctx)
		})
		if err == nil && res != inbox.Processed {
			err = fmt.Errorf("result %v, want Processed", res)
		}
		first <- err
	}()
	<-entered
	_, err := b.in.Process(t.Context(), "m-1", b.apply("m-1"))
	if !errors.Is(err, inbox.ErrInProgress) {
		t.Fatalf("duplicate during a live claim: %v, want ErrInProgress", err)
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatalf("first delivery: %v", err)
	}
	res, err := b.in.Process(t.Context(), "m-1", b.apply("m-1"))
	if err != nil || res != inbox.Duplicate {
		t.Fatalf("after the first finished: %v, %v; want Duplicate", res, err)
	}
	if n := b.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want once", n)
	}
}

func TestClaimOutlivedByItsHandlerIsTakenOverSafely(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{Standalone: inbox.StandaloneConfig{Lease: 200 * time.Millisecond}})
	entered, release := make(chan struct{}), make(chan struct{})
	slow := make(chan error, 1)
	go func() {
		_, err := b.in.Process(t.Context(), "m-1", func(ctx context.Context) error {
			close(entered)
			<-release // outlives the lease
			return b.apply("m-1")(ctx)
		})
		slow <- err
	}()
	<-entered
	res, err := processUntilSettled(t.Context(), b.in, "m-1", b.apply("m-1"))
	if err != nil || res != inbox.Processed {
		t.Fatalf("taker: %v, %v; want Processed after the lease ran out", res, err)
	}
	close(release)
	if err := <-slow; err != nil {
		t.Fatalf("slow holder: %v", err)
	}
	b.exactlyOnce(t, "m-1") // both runs, one effect
	b.mustBeDone(t, "m-1", true)
}

func TestHandlerErrorLeavesNoRecord(t *testing.T) {
	t.Parallel()
	// With buffered records too: a record buffered before the handler
	// succeeded would be seen by IsDone and by the redelivery.
	variants := append(slices.Clone(standaloneVariants), struct {
		name string
		cfg  inbox.Config
	}{"buffered", inbox.Config{Standalone: inbox.StandaloneConfig{FlushInterval: time.Hour}}})
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			b := standalone(t, v.cfg)
			t.Cleanup(func() { closeInbox(t, b.in) })
			boom := errors.New("boom")
			_, err := b.in.Process(t.Context(), "m-1", func(context.Context) error { return boom })
			if !errors.Is(err, inbox.ErrHandler) || !errors.Is(err, boom) {
				t.Fatalf("Process: %v, want ErrHandler wrapping the handler's error", err)
			}
			b.mustBeDone(t, "m-1", false)
			if n := b.records(t); n != 0 {
				t.Fatalf("%d records after a handler error, want 0 (a claim must be released)", n)
			}
			// The retry runs the handler again, at once.
			res, err := b.in.Process(t.Context(), "m-1", b.apply("m-1"))
			if err != nil || res != inbox.Processed {
				t.Fatalf("retry: %v, %v; want Processed", res, err)
			}
			if n := b.runs.Load(); n != 1 {
				t.Fatalf("the retry's handler ran %d times, want once", n)
			}
			b.exactlyOnce(t, "m-1")
			closeInbox(t, b.in)
			if got := b.recordState(t, "m-1"); got != "done" {
				t.Fatalf("record after the retry: state %q, want done", got)
			}
		})
	}
}

func TestMessageWithoutUsableIDIsRefused(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{})
	for name, id := range map[string]string{
		"empty":        "",
		"oversized":    strings.Repeat("x", 1025),
		"invalid utf8": "\xff\xfe",
		"nul":          "a\x00b",
	} {
		t.Run(name, func(t *testing.T) {
			_, err := b.in.Process(t.Context(), id, b.apply(id))
			if !errors.Is(err, inbox.ErrInvalidMessageID) {
				t.Fatalf("Process(%q): %v, want ErrInvalidMessageID", id, err)
			}
		})
	}
	if n := b.runs.Load(); n != 0 {
		t.Fatalf("handler ran %d times for refused ids", n)
	}
	if n := b.records(t); n != 0 {
		t.Fatalf("%d records written for refused ids", n)
	}
}

func TestConsumersDeduplicateIndependently(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	b := setup(t, db, inbox.Config{Consumer: "shipping"})
	other, err := inbox.New(db, inbox.Config{Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range []*inbox.Inbox{b.in, other} {
		res, err := in.Process(t.Context(), "m-1", func(context.Context) error { return nil })
		if err != nil || res != inbox.Processed {
			t.Fatalf("first delivery to a consumer: %v, %v; want Processed", res, err)
		}
	}
	if n := b.records(t); n != 2 {
		t.Fatalf("%d records, want one per consumer", n)
	}
}

func TestForcedTransactionModeFailsOnFerretDBWithoutRecording(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{Mode: inbox.ModeTransaction})
	_, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
	if err == nil {
		t.Fatal("Process in ModeTransaction on a server without transactions succeeded")
	}
	b.exactlyOnce(t)
	if n := b.records(t); n != 0 {
		t.Fatalf("%d records after a failed transaction, want none", n)
	}
}

func TestPurgeExpiresRecordsAfterRetention(t *testing.T) {
	t.Parallel()
	// Without the done cache, which would (rightly) still know m-1 is done
	// after its record was purged: this test is about the records.
	b := standalone(t, inbox.Config{Retention: time.Hour, DoneCacheSize: -1, Standalone: inbox.StandaloneConfig{Lease: time.Second}})
	for _, id := range []string{"m-1", "m-2"} {
		if _, err := b.in.Process(t.Context(), id, b.apply(id)); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now()
	if n, err := b.in.Purge(t.Context(), now); err != nil || n != 0 {
		t.Fatalf("Purge(now) deleted %d, %v; want 0: records are within retention", n, err)
	}
	n, err := b.in.Purge(t.Context(), now.Add(time.Hour+time.Minute))
	if err != nil || n != 2 {
		t.Fatalf("Purge(after retention) deleted %d, %v; want 2", n, err)
	}
	b.mustBeDone(t, "m-1", false)
	// A duplicate later than retention runs the handler again; the effect's
	// own idempotence still keeps one effect.
	res, err := b.in.Process(t.Context(), "m-1", b.apply("m-1"))
	if err != nil || res != inbox.Processed {
		t.Fatalf("late duplicate: %v, %v", res, err)
	}
	if n := b.runs.Load(); n != 3 {
		t.Fatalf("handler ran %d times, want 3", n)
	}
	b.exactlyOnce(t, "m-1", "m-2")
}

func TestPurgeDeletesOnlyExpiredRecords(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{Retention: time.Hour})
	const n = 300
	docs := make([]any, n)
	old := time.Now().Add(-2 * time.Hour)
	for i := range docs {
		docs[i] = bson.D{
			{Key: "_id", Value: fmt.Sprintf("test/%d", i)},
			{Key: "state", Value: "done"}, {Key: "processed_at", Value: old}, {Key: "expire_at", Value: old.Add(time.Hour)},
		}
	}
	if _, err := b.in.Collection().InsertMany(t.Context(), docs); err != nil {
		t.Fatal(err)
	}
	if _, err := b.in.Process(t.Context(), "fresh", b.apply("fresh")); err != nil {
		t.Fatal(err)
	}
	deleted, err := b.in.Purge(t.Context(), time.Now())
	if err != nil || deleted != n {
		t.Fatalf("Purge deleted %d, %v; want %d", deleted, err, n)
	}
	b.mustBeDone(t, "fresh", true)
}

func TestRunPurgerExpiresRecordsWithoutTTL(t *testing.T) {
	t.Parallel()
	b := standalone(t, inbox.Config{Retention: time.Second})
	if _, err := b.in.Process(t.Context(), "m-1", b.apply("m-1")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- b.in.RunPurger(ctx, 50*time.Millisecond) }()
	deadline := time.Now().Add(20 * time.Second)
	for b.records(t) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("record not purged 20s after a 1s retention")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-errc; err != nil {
		t.Fatalf("RunPurger returned %v on cancel, want nil", err)
	}
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	for name, cfg := range map[string]inbox.Config{
		"no consumer":           {},
		"consumer with NUL":     {Consumer: "a\x00"},
		"consumer with slash":   {Consumer: "a/b"},
		"bad collection":        {Consumer: "c", Collection: "a$b"},
		"system collection":     {Consumer: "c", Collection: "system.x"},
		"negative retention":    {Consumer: "c", Retention: -time.Second},
		"sub-second retention":  {Consumer: "c", Retention: time.Millisecond},
		"negative lease":        {Consumer: "c", Standalone: inbox.StandaloneConfig{Lease: -1}},
		"lease above retention": {Consumer: "c", Retention: time.Hour, Standalone: inbox.StandaloneConfig{Lease: 2 * time.Hour}},
		"unknown mode":          {Consumer: "c", Mode: "eventual"},
		"lease in tx mode":      {Consumer: "c", Mode: inbox.ModeTransaction, Standalone: inbox.StandaloneConfig{Lease: time.Second}},
		"negative attempts":     {Consumer: "c", Transaction: inbox.TransactionConfig{MaxAttempts: -1}},
		"negative retry budget": {Consumer: "c", Transaction: inbox.TransactionConfig{RetryBudget: -time.Second}},
		"tx budget in standalone mode": {Consumer: "c", Mode: inbox.ModeStandalone,
			Transaction: inbox.TransactionConfig{RetryBudget: time.Minute}},
		"tx attempts in standalone mode": {Consumer: "c", Mode: inbox.ModeStandalone,
			Transaction: inbox.TransactionConfig{MaxAttempts: 3}},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := inbox.New(db, cfg); err == nil {
				t.Fatalf("New(%+v) succeeded, want an error", cfg)
			}
		})
	}
	if _, err := inbox.New(nil, inbox.Config{Consumer: "c"}); err == nil {
		t.Fatal("New(nil db) succeeded")
	}
}

func TestResultString(t *testing.T) {
	for r, want := range map[inbox.Result]string{inbox.Processed: "processed", inbox.Duplicate: "duplicate", 0: "Result(0)"} {
		if got := r.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int(r), got, want)
		}
	}
}

func TestStandaloneRecordWritesWaitForTheJournal(t *testing.T) {
	t.Parallel()
	base := inboxtest.Database(t)
	var mu sync.Mutex
	var unjournaled []string
	client, err := mongo.Connect(options.Client().ApplyURI(inboxtest.URI(t)).SetMonitor(&event.CommandMonitor{
		Started: func(_ context.Context, e *event.CommandStartedEvent) {
			switch e.CommandName {
			case "insert", "update", "delete":
			default:
				return
			}
			if coll, _ := e.Command.Lookup(e.CommandName).StringValueOK(); coll != "inbox" {
				return
			}
			if j, _ := e.Command.Lookup("writeConcern", "j").BooleanOK(); !j {
				mu.Lock()
				defer mu.Unlock()
				unjournaled = append(unjournaled, e.Command.String())
			}
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	db := client.Database(base.Name())
	for _, v := range []struct {
		name string
		cfg  inbox.Config
	}{{"plain", inbox.Config{Consumer: "plain"}}, {"claim", inbox.Config{Consumer: "claim", Standalone: inbox.StandaloneConfig{Lease: time.Minute}}}, {"buffered", inbox.Config{Consumer: "buffered", Standalone: inbox.StandaloneConfig{FlushInterval: time.Hour}}}} {
		b := setup(t, db, v.cfg)
		if res, err := b.in.Process(t.Context(), "m-1", b.apply(v.name+"/m-1")); err != nil || res != inbox.Processed {
			t.Fatalf("%s: %v, %v", v.name, res, err)
		}
		closeInbox(t, b.in)
	}
	if n := func() int64 { n, _ := db.Collection("inbox").CountDocuments(t.Context(), bson.D{}); return n }(); n != 3 {
		t.Fatalf("%d records, want 3", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(unjournaled) != 0 {
		t.Fatalf("record writes without j:true: %v", unjournaled)
	}
}

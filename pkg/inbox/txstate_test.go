package inbox

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/readpref"
)

// These tests drive ModeTransaction's state machine (processTx) through
// fakeTx, which returns the driver's errors with the labels and codes a
// replica set puts on them. They need no server and run everywhere; the
// tests in transaction_test.go check the same protocol on a real replica
// set where one is available.

// txInbox returns an Inbox in ModeTransaction on fake, with no done cache
// unless cfg asks for one (every Process reaches the state machine) and
// near-zero pauses.
func txInbox(t *testing.T, fake *fakeTx, cfg Config) *Inbox {
	t.Helper()
	// The client never dials: every operation of ModeTransaction goes to fake.
	client, err := mongo.Connect(options.Client().ApplyURI("mongodb://127.0.0.1:9"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.Background()) })
	cfg.Consumer = "test"
	cfg.Mode = ModeTransaction
	if cfg.DoneCacheSize == 0 {
		cfg.DoneCacheSize = -1
	}
	in, err := New(client.Database("db"), cfg)
	if err != nil {
		t.Fatal(err)
	}
	in.tx = fake
	in.txBackoff = func(int) time.Duration { return 50 * time.Microsecond }
	return in
}

// hasCode reports whether err wraps a command error with code (the driver's
// error values hold slices, so errors.Is cannot compare them).
func hasCommandCode(err error, code int32) bool {
	var ce mongo.CommandError
	return errors.As(err, &ce) && ce.Code == code
}

// counting returns a handler that counts its runs and returns err.
func counting(runs *atomic.Int64, err error) Handler {
	return func(ctx context.Context) error {
		if ctx.Value(fakeSessionKey{}) == nil {
			return errors.New("handler got a context without the session")
		}
		runs.Add(1)
		return err
	}
}

func TestTxWriteConflictIsRetriedPastFiveAttempts(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	// The record is held by an orphaned transaction: every insert meets a
	// write conflict until the server aborts the orphan.
	fake.fail(opInsert, times(12, errWriteConflict)...)
	in := txInbox(t, fake, Config{})
	var runs atomic.Int64
	res, err := in.Process(t.Context(), "m-1", counting(&runs, nil))
	if err != nil || res != Processed {
		t.Fatalf("Process: %v, %v; want Processed once the conflict ended", res, err)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want once", n)
	}
	if fake.majority["test/m-1"] == nil {
		t.Fatal("no committed record")
	}
}

func TestTxConflictOutlastingTheBudgetIsTransientNotAHandlerFailure(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	fake.failAlways(opInsert, errWriteConflict)
	in := txInbox(t, fake, Config{Transaction: TransactionConfig{RetryBudget: 30 * time.Millisecond}})
	var runs atomic.Int64
	start := time.Now()
	_, err := in.Process(t.Context(), "m-1", counting(&runs, nil))
	if !errors.Is(err, ErrTransient) || errors.Is(err, ErrHandler) {
		t.Fatalf("Process: %v; want ErrTransient, not ErrHandler", err)
	}
	var te *TransientError
	if !errors.As(err, &te) || te.Attempts < 2 || te.CommitUnknown || !hasCommandCode(err, errWriteConflict.Code) {
		t.Fatalf("Process: %#v; want a *TransientError of several attempts wrapping the write conflict", err)
	}
	if elapsed := time.Since(start); elapsed < 30*time.Millisecond {
		t.Fatalf("gave up after %v, before the 30ms budget", elapsed)
	}
	if n := runs.Load(); n != 0 {
		t.Fatalf("handler ran %d times, want never (the record was never inserted)", n)
	}
	if got, want := fake.count(opAbort), fake.count(opStart); got != want {
		t.Fatalf("%d aborts for %d transactions, want each aborted", got, want)
	}
}

func TestTxMaxTransactionAttemptsStillBoundsTheAttempts(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	fake.failAlways(opInsert, errWriteConflict)
	in := txInbox(t, fake, Config{Transaction: TransactionConfig{MaxAttempts: 3}})
	_, err := in.Process(t.Context(), "m-1", counting(new(atomic.Int64), nil))
	if !errors.Is(err, ErrTransient) || errors.Is(err, ErrHandler) {
		t.Fatalf("Process: %v; want ErrTransient", err)
	}
	if n := fake.count(opStart); n != 3 {
		t.Fatalf("%d transactions, want 3", n)
	}
}

func TestTxRecordIsReadBeforeItIsInserted(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	fake.majority["test/m-1"] = &record{State: stateDone}
	in := txInbox(t, fake, Config{})
	var runs atomic.Int64
	res, err := in.Process(t.Context(), "m-1", counting(&runs, nil))
	if err != nil || res != Duplicate {
		t.Fatalf("Process: %v, %v; want Duplicate", res, err)
	}
	// A duplicate key would have aborted the transaction on the server: the
	// record is looked up first, and nothing is written when it is there.
	if n := fake.count(opInsert); n != 0 {
		t.Fatalf("%d inserts of a record that was there, want 0 (read before insert)", n)
	}
	if runs.Load() != 0 || fake.count(opCommit) != 0 || fake.count(opAbort) != 1 {
		t.Fatalf("handler runs %d, commits %d, aborts %d; want 0, 0, 1", runs.Load(), fake.count(opCommit), fake.count(opAbort))
	}
}

func TestTxDuplicateKeyIsConfirmedByAMajorityRead(t *testing.T) {
	t.Parallel()
	t.Run("record becomes majority-committed", func(t *testing.T) {
		t.Parallel()
		fake := newFakeTx()
		// Another consumer's commit reached the primary but not yet a
		// majority: the snapshot does not show it, the insert's unique
		// index does.
		fake.local["test/m-1"] = &record{State: stateDone}
		fake.hook(opMajority, func(call int) {
			if call == 3 {
				fake.majority["test/m-1"], fake.local["test/m-1"] = fake.local["test/m-1"], nil
			}
		})
		in := txInbox(t, fake, Config{})
		var runs atomic.Int64
		res, err := in.Process(t.Context(), "m-1", counting(&runs, nil))
		if err != nil || res != Duplicate {
			t.Fatalf("Process: %v, %v; want Duplicate once a majority has the record", res, err)
		}
		if n := fake.count(opMajority); n < 3 {
			t.Fatalf("%d majority reads, want Duplicate only after one found the record", n)
		}
		if runs.Load() != 0 {
			t.Fatalf("handler ran %d times, want never", runs.Load())
		}
	})
	t.Run("record rolled back", func(t *testing.T) {
		t.Parallel()
		fake := newFakeTx()
		fake.local["test/m-1"] = &record{State: stateDone}
		// The primary that had it steps down and the record is rolled back.
		fake.hook(opMajority, func(call int) {
			if call == 2 {
				delete(fake.local, "test/m-1")
			}
		})
		in := txInbox(t, fake, Config{})
		var runs atomic.Int64
		res, err := in.Process(t.Context(), "m-1", counting(&runs, nil))
		if err != nil || res != Processed {
			t.Fatalf("Process: %v, %v; want Processed: the record it collided with was never durable", res, err)
		}
		if runs.Load() != 1 || fake.majority["test/m-1"] == nil {
			t.Fatalf("handler runs %d, record %v; want one run and a committed record", runs.Load(), fake.majority["test/m-1"])
		}
	})
}

func TestTxUnknownCommitResultIsRecommittedUntilKnown(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	// The first commit takes effect but its reply is lost; later ones keep
	// failing with an unknown result for a while (a failover), then succeed.
	fake.applyOnFail[opCommit] = true
	fake.fail(opCommit, times(9, errUnknownCommit)...)
	in := txInbox(t, fake, Config{})
	var runs atomic.Int64
	res, err := in.Process(t.Context(), "m-1", counting(&runs, nil))
	if err != nil || res != Processed {
		t.Fatalf("Process: %v, %v; want Processed", res, err)
	}
	if fake.count(opCommit) != 10 || fake.count(opStart) != 1 || runs.Load() != 1 {
		t.Fatalf("commits %d, transactions %d, handler runs %d; want 10, 1, 1 (re-commit, never re-run)",
			fake.count(opCommit), fake.count(opStart), runs.Load())
	}
}

func TestTxUnknownCommitOutlastingTheBudgetIsTransient(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	fake.failAlways(opCommit, errUnknownCommit)
	in := txInbox(t, fake, Config{Transaction: TransactionConfig{RetryBudget: 20 * time.Millisecond}})
	_, err := in.Process(t.Context(), "m-1", counting(new(atomic.Int64), nil))
	var te *TransientError
	if !errors.As(err, &te) || !te.CommitUnknown || !errors.Is(err, ErrTransient) || errors.Is(err, ErrHandler) {
		t.Fatalf("Process: %v; want a *TransientError with CommitUnknown, not ErrHandler", err)
	}
	if n := fake.count(opCommit); n < 2 {
		t.Fatalf("%d commits, want it re-committed", n)
	}
	if n := fake.count(opAbort); n != 0 {
		t.Fatalf("%d aborts, want none: a transaction whose commit may have happened is not aborted", n)
	}
}

func TestTxHandlerErrors(t *testing.T) {
	t.Parallel()
	t.Run("plain error: ErrHandler, aborted, no retry", func(t *testing.T) {
		t.Parallel()
		fake := newFakeTx()
		in := txInbox(t, fake, Config{})
		boom := errors.New("boom")
		var runs atomic.Int64
		_, err := in.Process(t.Context(), "m-1", counting(&runs, boom))
		if !errors.Is(err, ErrHandler) || !errors.Is(err, boom) || errors.Is(err, ErrTransient) {
			t.Fatalf("Process: %v; want ErrHandler wrapping the handler's error", err)
		}
		if runs.Load() != 1 || fake.count(opAbort) != 1 || fake.count(opCommit) != 0 || len(fake.majority) != 0 {
			t.Fatalf("runs %d, aborts %d, commits %d, records %d; want 1, 1, 0, 0",
				runs.Load(), fake.count(opAbort), fake.count(opCommit), len(fake.majority))
		}
	})
	t.Run("transient error returned by the handler: retried", func(t *testing.T) {
		t.Parallel()
		fake := newFakeTx()
		in := txInbox(t, fake, Config{})
		var runs atomic.Int64
		res, err := in.Process(t.Context(), "m-1", func(ctx context.Context) error {
			if runs.Add(1) < 3 {
				return errWriteConflict // the handler's own write conflicted
			}
			return nil
		})
		if err != nil || res != Processed || runs.Load() != 3 {
			t.Fatalf("Process: %v, %v after %d runs; want Processed after 3", res, err, runs.Load())
		}
	})
	t.Run("transaction aborted under a handler that returned nil", func(t *testing.T) {
		t.Parallel()
		// A handler that swallowed a write error (say, a duplicate key it
		// took for "already applied") returns nil, but the server aborted
		// the transaction: the commit fails with NoSuchTransaction, every
		// time.
		for name, commitErr := range map[string]error{
			"labelled":   errNoSuchTransaction,
			"unlabelled": mongo.CommandError{Code: errNoSuchTransaction.Code, Name: errNoSuchTransaction.Name, Message: errNoSuchTransaction.Message},
		} {
			fake := newFakeTx()
			fake.failAlways(opCommit, commitErr)
			in := txInbox(t, fake, Config{})
			var runs atomic.Int64
			_, err := in.Process(t.Context(), "m-1", counting(&runs, nil))
			if !errors.Is(err, ErrHandler) || errors.Is(err, ErrTransient) || !strings.Contains(err.Error(), "swallowed") {
				t.Fatalf("%s: Process: %v; want ErrHandler saying the handler swallowed a write error", name, err)
			}
			if n := runs.Load(); n != int64(abortedUnderHandlerLimit) {
				t.Fatalf("%s: handler ran %d times, want %d", name, n, abortedUnderHandlerLimit)
			}
		}
	})
}

func TestTxOtherErrorsAreNeitherHandlerFailuresNorTransient(t *testing.T) {
	t.Parallel()
	for name, op := range map[string]string{"read": opRead, "insert": opInsert, "commit": opCommit} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fake := newFakeTx()
			fake.fail(op, errUnauthorized)
			in := txInbox(t, fake, Config{})
			_, err := in.Process(t.Context(), "m-1", counting(new(atomic.Int64), nil))
			if err == nil || errors.Is(err, ErrHandler) || errors.Is(err, ErrTransient) || !hasCommandCode(err, errUnauthorized.Code) {
				t.Fatalf("Process: %v; want the database's error, neither ErrHandler nor ErrTransient", err)
			}
			if n := fake.count(opStart); n != 1 {
				t.Fatalf("%d transactions, want 1 (no retry)", n)
			}
		})
	}
}

func TestTxCancelledContextStopsTheRetries(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	ctx, cancel := context.WithCancel(t.Context())
	fake.hook(opInsert, func(call int) {
		fake.script[opInsert] = []error{errWriteConflict}
		if call == 3 {
			cancel()
		}
	})
	in := txInbox(t, fake, Config{})
	_, err := in.Process(ctx, "m-1", counting(new(atomic.Int64), nil))
	if !errors.Is(err, context.Canceled) || errors.Is(err, ErrHandler) {
		t.Fatalf("Process: %v; want context.Canceled", err)
	}
}

func TestTxHooksSeeEachAttemptsCheckAndTheCommit(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	fake.fail(opInsert, errWriteConflict) // the first attempt's check fails, transiently
	type stepKey struct{}
	var steps []string
	var bad []string
	in := txInbox(t, fake, Config{Hooks: Hooks{
		StartStep: func(ctx context.Context, step Step, msgID string) context.Context {
			return context.WithValue(ctx, stepKey{}, step)
		},
		EndStep: func(ctx context.Context, step Step, msgID string, r StepResult) {
			if ctx.Value(stepKey{}) != step {
				bad = append(bad, "EndStep without its step's context")
			}
			s := step.String()
			switch {
			case r.Err != nil:
				s += " error"
			case r.Duplicate:
				s += " duplicate"
			}
			steps = append(steps, s)
		},
	}})
	handler := func(ctx context.Context) error {
		if ctx.Value(stepKey{}) != nil {
			bad = append(bad, "the handler got a step's context")
		}
		if ctx.Value(fakeSessionKey{}) == nil {
			bad = append(bad, "the handler got no session")
		}
		steps = append(steps, "handler")
		return nil
	}
	res, err := in.Process(t.Context(), "m-1", handler)
	if err != nil || res != Processed {
		t.Fatalf("Process: %v, %v", res, err)
	}
	res, err = in.Process(t.Context(), "m-1", handler)
	if err != nil || res != Duplicate {
		t.Fatalf("second Process: %v, %v", res, err)
	}
	if len(bad) > 0 {
		t.Fatal(strings.Join(bad, "; "))
	}
	if got, want := strings.Join(steps, ", "), "check error, check, handler, record, check duplicate"; got != want {
		t.Fatalf("steps %q, want %q", got, want)
	}
}

func TestTxNoSuchTransactionReturnedByTheHandlerCountsAsAbortedUnderIt(t *testing.T) {
	t.Parallel()
	// A handler that swallows a duplicate key (which aborts the transaction
	// on the server) and then returns its next operation's error:
	// NoSuchTransaction, labelled TransientTransactionError, every time.
	fake := newFakeTx()
	in := txInbox(t, fake, Config{Transaction: TransactionConfig{RetryBudget: 200 * time.Millisecond}})
	var runs atomic.Int64
	_, err := in.Process(t.Context(), "m-1", counting(&runs, errNoSuchTransaction))
	if !errors.Is(err, ErrHandler) || errors.Is(err, ErrTransient) || !strings.Contains(err.Error(), "swallowed") {
		t.Fatalf("Process: %v; want ErrHandler saying the handler swallowed a write error", err)
	}
	if n := runs.Load(); n != int64(abortedUnderHandlerLimit) {
		t.Fatalf("handler ran %d times, want %d", n, abortedUnderHandlerLimit)
	}
	// A write conflict of the handler's own writes is still retried, and it
	// breaks the run of aborts.
	fake = newFakeTx()
	in = txInbox(t, fake, Config{})
	runs.Store(0)
	res, err := in.Process(t.Context(), "m-2", func(ctx context.Context) error {
		switch runs.Add(1) {
		case 1, 2, 4, 5:
			return errNoSuchTransaction
		case 3:
			return errWriteConflict
		}
		return nil
	})
	if err != nil || res != Processed || runs.Load() != 6 {
		t.Fatalf("Process: %v, %v after %d runs; want Processed after 6 (no three aborts in a row)", res, err, runs.Load())
	}
}

func TestTxTransactionsRunOnThePrimaryWithAJournaledMajorityCommit(t *testing.T) {
	t.Parallel()
	// The options each transaction starts with override the client's (the
	// URI's readPreference=secondaryPreferred, w=1): the driver's session
	// takes a transaction's read preference and write concern from them,
	// falling back to the client's only where they leave one unset.
	var o options.TransactionOptions
	for _, set := range txOptions.List() {
		if err := set(&o); err != nil {
			t.Fatal(err)
		}
	}
	if o.ReadPreference == nil || o.ReadPreference.Mode() != readpref.PrimaryMode {
		t.Errorf("transaction read preference %v, want primary whatever the URI says", o.ReadPreference)
	}
	if wc := o.WriteConcern; wc == nil || wc.W != "majority" || wc.Journal == nil || !*wc.Journal {
		t.Errorf("transaction write concern %+v, want majority with j: true", wc)
	}
	if rc := o.ReadConcern; rc == nil || rc.Level != "snapshot" {
		t.Errorf("transaction read concern %+v, want snapshot", rc)
	}
}

func TestTxIsDoneReadsWithMajority(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	in := txInbox(t, fake, Config{DoneCacheSize: 100})
	// The client is never dialled: a read that does not go through the
	// majority read fails once this deadline passes.
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	// On the primary only: a failover can still roll it back.
	fake.local["test/m-1"] = &record{State: stateDone}
	if done, err := in.IsDone(ctx, "m-1"); err != nil || done {
		t.Fatalf("IsDone of a record a majority does not have: %v, %v; want false", done, err)
	}
	delete(fake.local, "test/m-1") // rolled back
	fake.majority["test/m-2"] = &record{State: stateDone}
	for range 2 {
		if done, err := in.IsDone(ctx, "m-2"); err != nil || !done {
			t.Fatalf("IsDone of a majority-committed record: %v, %v; want true", done, err)
		}
	}
	if n := fake.count(opMajority); n != 2 {
		t.Fatalf("%d majority reads, want 2: m-1 (not cached), m-2 (then cached)", n)
	}
}

// A handler slower than the server's transactionLifetimeLimitSeconds finds
// its transaction aborted under it at every attempt, and only two attempts
// of 60 s fit the 90 s budget: Process must end with the handler's failure
// (the consumer counts an attempt, then dead-letters it as a handler
// failure), not ErrTransient (deferred without counting, then dead-lettered
// as an inbox failure). Scaled down: attempts of 150 ms, a budget of 200 ms.
func TestTxHandlerOutlivingItsTransactionUntilTheBudgetEndsIsAHandlerFailure(t *testing.T) {
	t.Parallel()
	fake := newFakeTx()
	in := txInbox(t, fake, Config{Transaction: TransactionConfig{RetryBudget: 200 * time.Millisecond}})
	var runs atomic.Int64
	_, err := in.Process(t.Context(), "m-1", func(ctx context.Context) error {
		runs.Add(1)
		time.Sleep(150 * time.Millisecond)
		return errNoSuchTransaction // the server reaped the transaction meanwhile
	})
	if runs.Load() >= int64(abortedUnderHandlerLimit) {
		t.Fatalf("handler ran %d times: the budget should have ended the attempts first", runs.Load())
	}
	if !errors.Is(err, ErrHandler) || errors.Is(err, ErrTransient) {
		t.Fatalf("Process after %d attempts: %v; want ErrHandler (every attempt aborted under the handler), not ErrTransient", runs.Load(), err)
	}
	// A budget that ends on a conflict of the record (not under the
	// handler) stays transient.
	fake = newFakeTx()
	in = txInbox(t, fake, Config{Transaction: TransactionConfig{RetryBudget: 200 * time.Millisecond}})
	runs.Store(0)
	_, err = in.Process(t.Context(), "m-2", func(ctx context.Context) error {
		if runs.Add(1) == 1 {
			time.Sleep(150 * time.Millisecond)
			return errNoSuchTransaction
		}
		time.Sleep(100 * time.Millisecond)
		return errWriteConflict
	})
	if !errors.Is(err, ErrTransient) {
		t.Fatalf("Process ending on a write conflict: %v; want ErrTransient", err)
	}
}

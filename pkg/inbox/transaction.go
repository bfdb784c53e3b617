package inbox

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
)

// Error labels the server puts on errors inside transactions.
const (
	labelTransient     = "TransientTransactionError"
	labelUnknownCommit = "UnknownTransactionCommitResult"
)

// codeNoSuchTransaction is the server's answer to an operation or a commit
// of a transaction it has aborted (after a write error inside it, past
// transactionLifetimeLimitSeconds, after a failover).
const codeNoSuchTransaction = 251

// abortedUnderHandlerLimit is how many attempts in a row may find their
// transaction aborted by the server under the handler (NoSuchTransaction at
// the commit of a handler that returned nil, or from the handler's own
// operations) before Process calls it a handler failure: a handler that
// swallows a write error (which aborts the transaction on the server), or
// outlives the server's transactionLifetimeLimitSeconds, does that every
// time, a failover once.
const abortedUnderHandlerLimit = 3

// ErrTransient is matched (errors.Is) by the *TransientError Process
// returns in ModeTransaction when transient errors outlasted
// Config.Transaction.RetryBudget. It is not a handler failure: nothing was
// committed, or (CommitUnknown) the record and the effect were committed
// together; either way a later redelivery settles it. Retry the message
// later (a delay queue) without counting it as a failed attempt.
var ErrTransient = errors.New("inbox: transient transaction failure")

// TransientError says why Process gave up on a message in ModeTransaction
// without a verdict. errors.Is(err, ErrTransient) matches it.
type TransientError struct {
	MessageID string
	// Attempts is how many transactions were tried.
	Attempts int
	// Elapsed is how long Process tried.
	Elapsed time.Duration
	// CommitUnknown: the last commit's outcome is still unknown, so the
	// record and the handler's writes are both committed or both absent; a
	// redelivery finds out which (Duplicate, or processed again).
	CommitUnknown bool
	// Err is the last error.
	Err error
}

func (e *TransientError) Error() string {
	what := "transient errors"
	if e.CommitUnknown {
		what = "commit outcome still unknown"
	}
	return fmt.Sprintf("inbox: message %s: %s after %d attempts in %v: %v",
		e.MessageID, what, e.Attempts, e.Elapsed.Round(time.Millisecond), e.Err)
}

func (e *TransientError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrTransient) true.
func (e *TransientError) Is(target error) bool { return target == ErrTransient }

// errNotDurable is the last error of an attempt whose record collided with
// one a majority does not have (yet).
var errNotDurable = errors.New("duplicate key on a record a majority of the replica set does not have (yet)")

// txOutcome is the end of one transaction attempt.
type txOutcome struct {
	res Result
	err error
	// retry: transient, try a new transaction.
	retry bool
	// abortedUnderHandler: the server had aborted the transaction under the
	// handler: its commit failed with NoSuchTransaction although the handler
	// returned nil, or the handler returned NoSuchTransaction itself.
	abortedUnderHandler bool
	// commitUnknown: the budget ran out while the commit's outcome was
	// unknown.
	commitUnknown bool
}

// processTx runs one transaction per attempt: read the record (in the
// transaction's snapshot); if it is there, confirm it with a majority read
// and answer Duplicate; if not, insert it, run the handler, commit. Nothing
// is ever recovered inside the transaction: any write error has aborted it
// on the server, so it is aborted and, if transient, tried again.
//
// Transient errors (TransientTransactionError: a write conflict with a
// concurrent duplicate or with an orphaned transaction holding the record, a
// failover) are retried with backoff until Transaction.RetryBudget has
// passed, then Process returns a *TransientError (ErrTransient). A commit
// whose outcome is unknown (UnknownTransactionCommitResult) is committed
// again, never re-run, within the same budget. A duplicate key is answered
// Duplicate only once a majority read finds the record: until then the
// record it collided with may still be rolled back.
//
// Unlike Session.WithTransaction, a handler error ends Process at once
// (ErrHandler) unless it carries TransientTransactionError.
func (in *Inbox) processTx(ctx context.Context, msgID string, handler Handler) (Result, error) {
	sess, err := in.tx.startSession()
	if err != nil {
		return 0, fmt.Errorf("inbox: start session: %w", err)
	}
	defer sess.end(context.WithoutCancel(ctx))

	start := time.Now()
	deadline := start.Add(in.txBudget)
	giveUp := func(attempts int, commitUnknown bool, last error) error {
		return &TransientError{MessageID: msgID, Attempts: attempts, Elapsed: time.Since(start), CommitUnknown: commitUnknown, Err: last}
	}
	var lastErr error
	abortedInARow := 0
	for attempt := 1; ; attempt++ {
		if attempt > 1 {
			if in.maxAttempts > 0 && attempt > in.maxAttempts || !time.Now().Before(deadline) {
				if abortedInARow == attempt-1 {
					// Every attempt found its transaction aborted under the
					// handler: the handler's doing (a swallowed write error,
					// or slower than the server's transaction lifetime, when
					// fewer than abortedUnderHandlerLimit attempts fit the
					// budget), not a transient state of the database.
					return 0, handlerError(fmt.Errorf("the server aborted the transaction under the handler in each of the %d attempts the budget allowed "+
						"(a handler slower than the server's transactionLifetimeLimitSeconds, or one that swallowed a write error): %w", abortedInARow, lastErr))
				}
				return 0, giveUp(attempt-1, false, lastErr)
			}
			if err := sleep(ctx, min(in.txBackoff(attempt), time.Until(deadline))); err != nil {
				return 0, fmt.Errorf("inbox: transaction for message %s: %w (last error: %w)", msgID, err, lastErr)
			}
		}
		out := in.tryTx(ctx, sess, msgID, handler, deadline)
		switch {
		case out.commitUnknown:
			return 0, giveUp(attempt, true, out.err)
		case !out.retry:
			if out.err == nil { // committed now, or before
				in.cache.add(msgID)
			}
			if out.err == nil && out.res == Processed {
				in.tally(ctx, msgID)
			}
			return out.res, out.err
		}
		lastErr = out.err
		if out.abortedUnderHandler {
			abortedInARow++
			in.log.WarnContext(ctx, "inbox: transaction aborted by the server under the handler (NoSuchTransaction); retrying",
				"message_id", msgID, "attempt", attempt, "error", out.err)
			if abortedInARow >= abortedUnderHandlerLimit {
				return 0, handlerError(fmt.Errorf("the server aborted the transaction under the handler %d times in a row (NoSuchTransaction at its commit or from its own operations): "+
					"a write error inside a transaction aborts it, so a handler that swallowed one (say, a duplicate key taken for \"already applied\") "+
					"must return it instead, and read before it writes; a handler slower than the server's transactionLifetimeLimitSeconds meets the same: %w", abortedInARow, out.err))
			}
		} else {
			abortedInARow = 0
			in.log.DebugContext(ctx, "inbox: transient transaction error, retrying", "message_id", msgID, "attempt", attempt, "error", out.err)
		}
	}
}

// tryTx runs one transaction attempt.
func (in *Inbox) tryTx(ctx context.Context, sess txSession, msgID string, handler Handler, deadline time.Time) txOutcome {
	if err := sess.startTransaction(); err != nil {
		return txOutcome{err: fmt.Errorf("inbox: start transaction: %w", err)}
	}
	sctx := sess.context(ctx)
	abort := func() {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		// The server has aborted it already after a write error, and aborts
		// it by itself after transactionLifetimeLimitSeconds.
		_ = sess.abort(actx)
	}
	key := in.key(msgID)

	// The check: is the record there, and if not, insert it. Its operations
	// use the step's context, carrying the session too.
	cctx, csctx := in.startStep(ctx, StepCheck, msgID), sctx
	if cctx != ctx {
		csctx = sess.context(cctx)
	}
	if out, decided := in.checkTx(cctx, csctx, sess, msgID, key, abort); decided {
		in.endStep(cctx, StepCheck, msgID, StepResult{Duplicate: out.res == Duplicate && out.err == nil, Err: out.err})
		return out
	}
	in.endStep(cctx, StepCheck, msgID, StepResult{})

	if err := handler(sctx); err != nil {
		abort()
		if hasLabel(err, labelTransient) {
			// NoSuchTransaction: the server had aborted the transaction under
			// the handler (most often after a write error the handler
			// swallowed), as when the commit finds it aborted.
			return txOutcome{retry: true, err: err, abortedUnderHandler: hasCode(err, codeNoSuchTransaction)}
		}
		return txOutcome{err: handlerError(err)}
	}

	if err := ctx.Err(); err != nil {
		abort()
		return txOutcome{err: fmt.Errorf("inbox: before commit of message %s: %w", msgID, err)}
	}
	rctx := in.startStep(ctx, StepRecord, msgID)
	out := in.commitTx(rctx, sess, msgID, deadline)
	in.endStep(rctx, StepRecord, msgID, StepResult{Err: out.err})
	return out
}

// checkTx is tryTx's check: read the record in the transaction's snapshot
// and, if it is not there, insert it. decided: the attempt ends with out
// (a duplicate, an error, or a retry) and the transaction was aborted;
// otherwise the record is inserted and the handler runs next. ctx is the
// step's context, sctx the same carrying the session.
func (in *Inbox) checkTx(ctx, sctx context.Context, sess txSession, msgID, key string, abort func()) (out txOutcome, decided bool) {
	// Read before insert: inserting a record that is there would abort the
	// transaction on the server with a duplicate key.
	rec, err := sess.readRecord(sctx, key)
	if err != nil {
		abort()
		return transientOr(err, fmt.Errorf("inbox: read record %s: %w", msgID, err)), true
	}
	if rec != nil {
		abort()
		if rec.State != stateDone {
			return txOutcome{err: ErrInProgress}, true // a ModeStandalone Lease claim on the same collection
		}
		return in.confirmDuplicate(ctx, msgID), true
	}

	if err := sess.insertRecord(sctx, in.newRecord(msgID, in.doneFields(time.Now()))); err != nil {
		abort()
		if mongo.IsDuplicateKeyError(err) {
			// Committed after this transaction's snapshot, perhaps only on
			// the primary: Duplicate once a majority has it.
			return in.confirmDuplicate(ctx, msgID), true
		}
		return transientOr(err, fmt.Errorf("inbox: insert record %s: %w", msgID, err)), true
	}
	return txOutcome{}, false
}

// commitTx commits, and commits again while the outcome is unknown, within
// the budget. A commit is idempotent on the server, and only the commit
// outlives ctx, so a transaction whose handler finished is not left
// half-decided by a cancellation.
func (in *Inbox) commitTx(ctx context.Context, sess txSession, msgID string, deadline time.Time) txOutcome {
	for commit := 1; ; commit++ {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		err := sess.commit(cctx)
		cancel()
		switch {
		case err == nil:
			return txOutcome{res: Processed}
		case hasLabel(err, labelUnknownCommit):
			if !time.Now().Before(deadline) {
				return txOutcome{commitUnknown: true, err: err}
			}
			in.log.DebugContext(ctx, "inbox: commit outcome unknown, committing again", "message_id", msgID, "attempt", commit, "error", err)
			if serr := sleep(ctx, min(in.txBackoff(commit+1), time.Until(deadline))); serr != nil {
				return txOutcome{commitUnknown: true, err: errors.Join(err, serr)}
			}
		case hasLabel(err, labelTransient):
			// Not committed: the whole transaction is tried again.
			return txOutcome{retry: true, err: err, abortedUnderHandler: commit == 1 && hasCode(err, codeNoSuchTransaction)}
		case commit == 1 && isCommandError(err, codeNoSuchTransaction):
			// The first commit of a transaction the server had aborted
			// (without a write concern error: nothing can have committed).
			return txOutcome{retry: true, err: err, abortedUnderHandler: true}
		default:
			// The outcome may be unknown: the record and the effect are both
			// there or both absent, and a redelivery finds out which.
			return txOutcome{err: fmt.Errorf("inbox: commit message %s: %w", msgID, err)}
		}
	}
}

// confirmDuplicate answers Duplicate if a majority read finds msgID's record
// done, and asks for another attempt otherwise (the record seen may still be
// rolled back, or be gone already).
func (in *Inbox) confirmDuplicate(ctx context.Context, msgID string) txOutcome {
	rec, err := in.tx.readMajority(ctx, in.key(msgID))
	switch {
	case err != nil:
		return transientOr(err, fmt.Errorf("inbox: confirm record %s with a majority read: %w", msgID, err))
	case rec != nil && rec.State == stateDone:
		return txOutcome{res: Duplicate}
	case rec != nil:
		return txOutcome{err: ErrInProgress}
	default:
		return txOutcome{retry: true, err: errNotDurable}
	}
}

// transientOr retries err if it carries TransientTransactionError, and
// returns wrapped otherwise.
func transientOr(err, wrapped error) txOutcome {
	if hasLabel(err, labelTransient) {
		return txOutcome{retry: true, err: err}
	}
	return txOutcome{err: wrapped}
}

func hasLabel(err error, label string) bool {
	var le mongo.LabeledError
	return errors.As(err, &le) && le.HasErrorLabel(label)
}

func isCommandError(err error, code int32) bool {
	var ce mongo.CommandError
	return errors.As(err, &ce) && ce.Code == code
}

func hasCode(err error, code int) bool {
	var se mongo.ServerError
	return errors.As(err, &se) && se.HasErrorCode(code)
}

// backoff is the pause before attempt n (n >= 2): 10ms doubling, capped at
// 1s, with full jitter.
func backoff(n int) time.Duration {
	d := min(10*time.Millisecond<<min(n-2, 16), time.Second)
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

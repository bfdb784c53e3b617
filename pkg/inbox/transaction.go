package inbox

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/readconcern"
	"go.mongodb.org/mongo-driver/v2/mongo/writeconcern"
)

// Error labels the server puts on errors inside transactions.
const (
	labelTransient     = "TransientTransactionError"
	labelUnknownCommit = "UnknownTransactionCommitResult"
)

// processTx inserts the done record and runs the handler in one transaction.
// A duplicate key on the insert means the message was committed before:
// Duplicate. A concurrent duplicate's insert gets a write conflict
// (TransientTransactionError): the transaction is retried, and the retry sees
// either the committed record (Duplicate) or, if the other one aborted,
// nothing (it runs the handler).
//
// Unlike Session.WithTransaction, which retries until a 120s timeout, the
// attempts are bounded by MaxTransactionAttempts and nothing is retried on a
// non-transient error, so a handler error or a duplicate returns at once.
func (in *Inbox) processTx(ctx context.Context, msgID string, handler Handler) (Result, error) {
	sess, err := in.db.Client().StartSession()
	if err != nil {
		return 0, fmt.Errorf("inbox: start session: %w", err)
	}
	defer sess.EndSession(context.WithoutCancel(ctx))

	txOpts := options.Transaction().
		SetReadConcern(readconcern.Snapshot()).
		SetWriteConcern(writeconcern.Majority())

	var lastErr error
	for attempt := 1; attempt <= in.maxAttempts; attempt++ {
		if attempt > 1 {
			if err := sleep(ctx, backoff(attempt)); err != nil {
				return 0, fmt.Errorf("inbox: transaction for message %s: %w (last error: %w)", msgID, err, lastErr)
			}
		}
		res, retry, err := in.tryTx(ctx, sess, txOpts, msgID, handler)
		if !retry {
			if err == nil { // committed now, or before
				in.cache.add(msgID)
			}
			return res, err
		}
		lastErr = err
		in.log.DebugContext(ctx, "inbox: transient transaction error, retrying", "message_id", msgID, "attempt", attempt, "error", err)
	}
	return 0, fmt.Errorf("inbox: transaction for message %s: gave up after %d attempts: %w", msgID, in.maxAttempts, lastErr)
}

// tryTx runs one transaction attempt. retry reports a transient failure worth
// another attempt.
func (in *Inbox) tryTx(ctx context.Context, sess *mongo.Session, txOpts *options.TransactionOptionsBuilder, msgID string, handler Handler) (res Result, retry bool, err error) {
	if err := sess.StartTransaction(txOpts); err != nil {
		return 0, false, fmt.Errorf("inbox: start transaction: %w", err)
	}
	sctx := mongo.NewSessionContext(ctx, sess)
	abort := func() {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = sess.AbortTransaction(actx) // the server aborts on its own after transactionLifetimeLimitSeconds
	}

	if _, err := in.coll.InsertOne(sctx, in.newRecord(msgID, in.doneFields(time.Now()))); err != nil {
		abort()
		switch {
		case mongo.IsDuplicateKeyError(err):
			return Duplicate, false, nil
		case hasLabel(err, labelTransient):
			return 0, true, err
		default:
			return 0, false, fmt.Errorf("inbox: insert record %s: %w", msgID, err)
		}
	}

	if err := handler(sctx); err != nil {
		abort()
		if hasLabel(err, labelTransient) {
			return 0, true, err
		}
		return 0, false, handlerError(err)
	}

	if err := ctx.Err(); err != nil {
		abort()
		return 0, false, fmt.Errorf("inbox: before commit of message %s: %w", msgID, err)
	}

	// Commit is idempotent on the server: an unknown outcome is retried.
	// Only the commit outlives ctx, so a transaction whose handler finished
	// is not left half-decided by a cancellation.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	for commit := 1; ; commit++ {
		err := sess.CommitTransaction(cctx)
		switch {
		case err == nil:
			return Processed, false, nil
		case hasLabel(err, labelUnknownCommit) && !isMaxTimeMSExpired(err) && commit < in.maxAttempts:
			in.log.DebugContext(ctx, "inbox: commit outcome unknown, retrying commit", "message_id", msgID, "attempt", commit, "error", err)
			continue
		case hasLabel(err, labelTransient):
			return 0, true, err
		default:
			// The outcome may be unknown: the record and the effect are both
			// there or both absent, and a redelivery finds out which.
			return 0, false, fmt.Errorf("inbox: commit message %s: %w", msgID, err)
		}
	}
}

func hasLabel(err error, label string) bool {
	var le mongo.LabeledError
	return errors.As(err, &le) && le.HasErrorLabel(label)
}

func isMaxTimeMSExpired(err error) bool {
	var ce mongo.CommandError
	return errors.As(err, &ce) && ce.IsMaxTimeMSExpiredError()
}

// backoff is the pause before attempt n (n >= 2): 10ms doubling, capped at
// 500ms, with full jitter.
func backoff(n int) time.Duration {
	d := min(10*time.Millisecond<<(n-2), 500*time.Millisecond)
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

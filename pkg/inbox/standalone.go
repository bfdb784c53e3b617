package inbox

import (
	"context"
	"fmt"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
)

// The hot path of both standalone protocols selects records by _id alone:
// that is the one filter FerretDB's SQLite backend pushes down to SQLite
// (any other is evaluated over every document), and its conditional updates are not
// atomic anyway. Only the unique _id on insert is relied on for exclusion.

// processStandalone: check, run the idempotent handler, then record. The
// record is written (or buffered, with FlushInterval) only after the
// handler's writes were acknowledged, so a done record always means a
// durable effect; a crash in between leaves the effect without a record, and
// the redelivery runs the handler again, which its idempotence turns into a
// no-op.
func (in *Inbox) processStandalone(ctx context.Context, msgID string, handler Handler) (Result, error) {
	cctx := in.startStep(ctx, StepCheck, msgID)
	done, err := in.IsDone(cctx, msgID)
	in.endStep(cctx, StepCheck, msgID, StepResult{Duplicate: done && err == nil, Err: err})
	if err != nil {
		return 0, err
	}
	if done {
		return Duplicate, nil
	}
	if mutantInboxRecordFirst {
		// A planted bug (mutant_inbox_recordfirst.go): the record first.
		if err := in.recordDone(ctx, msgID); err != nil {
			return 0, err
		}
		in.cache.add(msgID)
		if err := handler(ctx); err != nil {
			return 0, handlerError(err)
		}
		return Processed, nil
	}
	if err := handler(ctx); err != nil {
		return 0, handlerError(err)
	}
	rctx := in.startStep(ctx, StepRecord, msgID)
	if in.buf != nil && in.bufferDone(msgID) {
		in.cache.add(msgID)
		in.endStep(rctx, StepRecord, msgID, StepResult{Buffered: true})
		return Processed, nil
	}
	err = in.recordDone(rctx, msgID)
	in.endStep(rctx, StepRecord, msgID, StepResult{Err: err})
	if err != nil {
		return 0, err
	}
	in.cache.add(msgID)
	return Processed, nil
}

// recordDone inserts the done record. A duplicate key means a concurrent
// duplicate recorded it first (fine: both handler runs made one effect) or a
// claim is there (from a Lease-mode consumer): it is turned into done.
func (in *Inbox) recordDone(ctx context.Context, msgID string) error {
	for attempt := 1; ; attempt++ {
		now := time.Now()
		_, err := in.coll.InsertOne(ctx, in.newRecord(msgID, in.doneFields(now)))
		if err == nil {
			in.tally(ctx, msgID)
			return nil
		}
		if !mongo.IsDuplicateKeyError(err) {
			return fmt.Errorf("inbox: record message %s done: %w", msgID, err)
		}
		settled, err := in.settleDuplicate(ctx, msgID, now)
		if settled || err != nil {
			return err
		}
		// A claim was released between the insert and the read: insert again.
		if attempt == 3 {
			return fmt.Errorf("inbox: record message %s done: its record keeps vanishing", msgID)
		}
	}
}

// settleDuplicate handles a duplicate key on inserting msgID's done record:
// the record there is done already (settled), or it is a claim, which is
// turned into done (settled). settled is false, without error, when the
// record vanished meanwhile (a released claim): insert it again.
func (in *Inbox) settleDuplicate(ctx context.Context, msgID string, now time.Time) (settled bool, err error) {
	rec, err := in.read(ctx, msgID)
	switch {
	case err != nil:
		return false, err
	case rec == nil:
		return false, nil
	case rec.State == stateDone:
		return true, nil
	}
	if err := in.markDone(ctx, msgID, now); err != nil {
		return false, err
	}
	return true, nil
}

// markDone turns msgID's record into a done record, whoever claimed it:
// "done" is only ever written after a handler run finished, and it is final.
func (in *Inbox) markDone(ctx context.Context, msgID string, now time.Time) error {
	_, err := in.coll.UpdateOne(ctx, in.byKey(msgID), bson.D{
		{Key: "$set", Value: in.doneFields(now)},
		{Key: "$unset", Value: bson.D{{Key: "owner", Value: ""}, {Key: "lease_until", Value: ""}}},
	})
	if err != nil {
		return fmt.Errorf("inbox: record message %s done: %w", msgID, err)
	}
	in.tally(ctx, msgID)
	return nil
}

// processClaimed: claim (a "processing" record with an owner and a lease),
// run the handler, then turn the claim into a done record. A concurrent
// duplicate finds the live claim and gets ErrInProgress; a claim whose holder
// died expires after the lease and is taken over.
func (in *Inbox) processClaimed(ctx context.Context, msgID string, handler Handler) (Result, error) {
	token := newToken()
	cctx := in.startStep(ctx, StepCheck, msgID)
	res, err := in.claim(cctx, msgID, token)
	in.endStep(cctx, StepCheck, msgID, StepResult{Duplicate: res == Duplicate, Err: err})
	if err != nil || res == Duplicate {
		if res == Duplicate {
			in.cache.add(msgID)
		}
		return res, err
	}

	if err := handler(ctx); err != nil {
		// Release the claim so a retry need not wait for the lease; if this
		// fails, the claim simply expires. The owner condition keeps a taker's
		// claim (rare, so the full scan it costs on FerretDB is acceptable).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_, derr := in.coll.DeleteOne(rctx, bson.D{
			{Key: "_id", Value: in.key(msgID)},
			{Key: "state", Value: stateProcessing},
			{Key: "owner", Value: token},
		})
		cancel()
		if derr != nil {
			in.log.WarnContext(ctx, "inbox: release claim after handler error", "message_id", msgID, "error", derr)
		}
		return 0, handlerError(err)
	}

	// If the lease ran out while the handler ran, another consumer may hold
	// the claim now: our effect is durable and its run is absorbed by the
	// handler's idempotence, so writing done over its claim is right.
	rctx := in.startStep(ctx, StepRecord, msgID)
	err = in.markDone(rctx, msgID, time.Now())
	in.endStep(rctx, StepRecord, msgID, StepResult{Err: err})
	if err != nil {
		return 0, err
	}
	in.cache.add(msgID)
	return Processed, nil
}

// claim takes the message for token, or reports it done (Duplicate) or
// claimed by someone else (ErrInProgress).
func (in *Inbox) claim(ctx context.Context, msgID, token string) (Result, error) {
	for range 3 {
		now := time.Now()
		leaseUntil := now.Add(in.lease)
		claimFields := bson.D{
			{Key: "state", Value: stateProcessing},
			{Key: "owner", Value: token},
			{Key: "lease_until", Value: leaseUntil},
			// A claim left by a dead consumer for a message never
			// redelivered is purged like a done record.
			{Key: "expire_at", Value: leaseUntil.Add(in.retention)},
		}
		_, err := in.coll.InsertOne(ctx, in.newRecord(msgID, claimFields))
		if err == nil {
			return 0, nil
		}
		if !mongo.IsDuplicateKeyError(err) {
			return 0, fmt.Errorf("inbox: claim message %s: %w", msgID, err)
		}

		rec, err := in.read(ctx, msgID)
		switch {
		case err != nil:
			return 0, err
		case rec == nil:
			continue // released meanwhile: claim again
		case rec.State == stateDone:
			return Duplicate, nil
		case rec.LeaseUntil.After(now):
			return 0, ErrInProgress
		}

		// Take over the expired claim. The filter on the old owner makes this
		// a compare-and-set on MongoDB; on FerretDB it is best effort (two
		// takers may both run the idempotent handler). Rare path.
		r, err := in.coll.UpdateOne(ctx,
			bson.D{{Key: "_id", Value: in.key(msgID)}, {Key: "state", Value: stateProcessing}, {Key: "owner", Value: rec.Owner}},
			bson.D{{Key: "$set", Value: claimFields}})
		if err != nil {
			return 0, fmt.Errorf("inbox: take over claim on message %s: %w", msgID, err)
		}
		if r.MatchedCount == 1 {
			in.log.InfoContext(ctx, "inbox: took over an expired claim", "message_id", msgID, "consumer", in.consumer)
			return 0, nil
		}
	}
	return 0, ErrInProgress
}

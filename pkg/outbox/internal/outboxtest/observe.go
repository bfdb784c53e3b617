package outboxtest

import (
	"context"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// On returns an Observer that calls f with the observations of kind k and
// hands every observation on to next (nil: none), so that a test adds what it
// waits on to whatever a configuration observes already:
//
//	cfg.Observer = outboxtest.On(cfg.Observer, outbox.KindConfirmed, f)
func On(next outbox.Observer, k outbox.ObservationKind, f func(outbox.Observation)) outbox.Observer {
	return outbox.ObserverFunc(func(ctx context.Context, o outbox.Observation) {
		if o.Kind == k {
			f(o)
		}
		if next != nil {
			next.Observe(ctx, o)
		}
	})
}

// OnBatch is On for KindBatchDone, with the batch's outcome.
func OnBatch(next outbox.Observer, f func(outbox.BatchResult)) outbox.Observer {
	return On(next, outbox.KindBatchDone, func(o outbox.Observation) { f(*o.Batch) })
}

// OnConfirmed is On for KindConfirmed, with the confirmed ids.
func OnConfirmed(next outbox.Observer, f func(ids []int64)) outbox.Observer {
	return On(next, outbox.KindConfirmed, func(o outbox.Observation) { f(o.IDs) })
}

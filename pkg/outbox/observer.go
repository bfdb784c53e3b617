package outbox

import (
	"context"
	"time"
)

// Observer receives what a relay does: counters and timings for metrics.
// The package itself imports no metrics library; wire an Observer to
// Prometheus or anything else. Gauges that describe the table (pending
// count, age of the oldest pending row, dead letters) come from
// outboxadmin's Admin.Status, which a collector calls on scrape.
//
// Observe is called synchronously by the relay's goroutines: it must be safe
// for concurrent use, and the relay waits while it runs, so keep it cheap.
// It must not modify or keep the slices of an Observation. Later versions may
// add kinds of Observation: ignore the kinds you do not know, so that a new
// one breaks no implementation.
type Observer interface {
	Observe(ctx context.Context, o Observation)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(ctx context.Context, o Observation)

// Observe calls f.
func (f ObserverFunc) Observe(ctx context.Context, o Observation) { f(ctx, o) }

var _ Observer = ObserverFunc(nil)

// ObservationKind says what an Observation reports.
type ObservationKind string

// The kinds of Observation a relay reports. The comment of each says which
// field of the Observation carries it; the other fields are zero.
const (
	// KindPublished (N): messages the broker confirmed, once per confirm (a
	// message published twice, after a lost mark, counts twice).
	KindPublished ObservationKind = "published"
	// KindFailed (N): publish attempts that did not end in a confirm, for
	// any reason, returned messages included.
	KindFailed ObservationKind = "failed"
	// KindReturned (N): messages the broker returned as unroutable (a subset
	// of KindFailed).
	KindReturned ObservationKind = "returned"
	// KindDeadLettered (N): rows that reached MaxAttempts: after a failed
	// last attempt, or at claim time for a row whose relays stopped while
	// publishing it.
	KindDeadLettered ObservationKind = "dead_lettered"
	// KindBatchDuration (Duration): one batch, from claim to the end of its
	// marking.
	KindBatchDuration ObservationKind = "batch_duration"
	// KindConfirmLatency (Duration): how long the publisher took to return
	// the verdicts of one batch: the broker's confirm latency for its
	// slowest message.
	KindConfirmLatency ObservationKind = "confirm_latency"
	// KindClaimFailed: a claim failed (a database error): the relay
	// publishes nothing while claims fail. Alert when it keeps happening.
	KindClaimFailed ObservationKind = "claim_failed"
	// KindMarkFailed: a statement recording a batch's outcome failed (a
	// database error): marking confirmed rows published, recording failed
	// attempts, or recording that confirmed rows could not be marked (after
	// which they count as in flight at a stop: see RelayConfig.MaxAttempts).
	// A failed mark is retried while the lease leaves time.
	KindMarkFailed ObservationKind = "mark_failed"
	// KindUnmarked (N): rows the broker confirmed that the relay could not
	// mark published before giving up (database errors, or the writer of
	// the next event holding the row for longer than the lease allows): each
	// will be published again after its lease, a duplicate.
	KindUnmarked ObservationKind = "unmarked"
	// KindListenReconnected: the relay had to open its LISTEN connection
	// again: it broke, stayed silent beyond ListenKeepalive and did not
	// answer a ping, or could not be opened. A steady rise means
	// notifications are being missed (the poll still finds the rows).
	KindListenReconnected ObservationKind = "listen_reconnected"
	// KindListenFallback (Fallback): true when the relay, configured with
	// NotifyChannel, got no answer to its LISTEN probe (typically a
	// transaction-pooling PgBouncer: see RelayConfig.ListenConfig) and relies
	// on its poll alone; false once a notification arrived.
	KindListenFallback ObservationKind = "listen_fallback"
)

// Observation is one thing a relay did. Kind says what; the field its
// kind's comment names carries the value.
type Observation struct {
	Kind ObservationKind
	// N counts rows or messages.
	N int
	// Duration is a timing.
	Duration time.Duration
	// Fallback is KindListenFallback's state.
	Fallback bool
}

// observe reports o to obs, if there is one.
func observe(ctx context.Context, obs Observer, o Observation) {
	if obs != nil {
		obs.Observe(ctx, o)
	}
}

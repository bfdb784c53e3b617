package outbox

import "time"

// Metrics receives the relay's counters and timings. Wire it to Prometheus or
// anything else; the package itself imports no metrics library. Methods are
// called from several goroutines and must be safe for concurrent use and cheap.
// Gauges that describe the table (pending count, age of the oldest pending row,
// dead letters) come from Admin.Status, which a collector calls on scrape.
//
// Embed NopMetrics to implement only some of the methods.
type Metrics interface {
	// Published counts messages the broker confirmed, once per confirm (a
	// message published twice, after a lost mark, counts twice).
	Published(n int)
	// Failed counts publish attempts that did not end in a confirm, for any
	// reason, returned messages included.
	Failed(n int)
	// Returned counts messages the broker returned as unroutable (a subset of
	// Failed).
	Returned(n int)
	// DeadLettered counts rows that reached MaxAttempts: after a failed last
	// attempt, or at claim time for a row whose relays stopped while
	// publishing it.
	DeadLettered(n int)
	// BatchDuration observes one batch, from claim to the end of its marking.
	BatchDuration(d time.Duration)
	// ConfirmLatency observes how long the publisher took to return the
	// verdicts of one batch: the broker's confirm latency for its slowest
	// message.
	ConfirmLatency(d time.Duration)
	// ClaimFailed counts claims that failed (a database error): the relay
	// publishes nothing while they do. Alert when it keeps growing.
	ClaimFailed()
	// MarkFailed counts statements recording a batch's outcome that failed
	// (a database error): marking confirmed rows published, recording failed
	// attempts, or recording that confirmed rows could not be marked (after
	// which they count as in flight at a stop: see RelayConfig.MaxAttempts).
	// A failed mark is retried while the lease leaves time.
	MarkFailed()
	// Unmarked counts rows the broker confirmed that the relay could not mark
	// published before giving up (database errors, or the writer of the next
	// event holding the row for longer than the lease allows): each will be
	// published again after its lease, a duplicate.
	Unmarked(n int)
	// ListenReconnected counts the times the relay had to open its LISTEN
	// connection again: it broke, stayed silent beyond ListenKeepalive and did
	// not answer a ping, or could not be opened. A steady rise means
	// notifications are being missed (the poll still finds the rows).
	ListenReconnected()
	// ListenFallback reports whether the relay, configured to LISTEN
	// (NotifyChannel), gave up on notifications and relies on its poll
	// alone: true when the notification it sent itself at start did not
	// arrive within ListenProbeTimeout (typically a transaction-pooling
	// PgBouncer between the relay and PostgreSQL: LISTEN needs a session of
	// its own; see RelayConfig.ListenConfig), false once one arrived. Events
	// still flow, up to PollInterval late. Never called without
	// NotifyChannel.
	ListenFallback(fallback bool)
	// Stranded counts rows the relay found blocked behind nothing (see
	// Admin.Stranded) and released. Any count means something writes to the
	// outbox the way this package does not: a writer of an older version of
	// it, or a hand-made change. Find it.
	Stranded(n int)
}

// NopMetrics discards everything. It is the relay's default.
type NopMetrics struct{}

var _ Metrics = NopMetrics{}

func (NopMetrics) Published(int)                {}
func (NopMetrics) Failed(int)                   {}
func (NopMetrics) Returned(int)                 {}
func (NopMetrics) DeadLettered(int)             {}
func (NopMetrics) BatchDuration(time.Duration)  {}
func (NopMetrics) ConfirmLatency(time.Duration) {}
func (NopMetrics) ClaimFailed()                 {}
func (NopMetrics) MarkFailed()                  {}
func (NopMetrics) Unmarked(int)                 {}
func (NopMetrics) ListenReconnected()           {}
func (NopMetrics) ListenFallback(bool)          {}
func (NopMetrics) Stranded(int)                 {}

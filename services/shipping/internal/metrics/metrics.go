// Package metrics holds the shipping service's Prometheus metrics.
package metrics

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

// SLOSeconds is the service level objective's threshold: 99% of the events
// applied within 5 seconds of their commit (docs/operations.md). The alerts
// read the bucket le="5".
const SLOSeconds = 5

// Metrics are the service's counters, registered on one registry.
type Metrics struct {
	// Processed counts events whose effect was applied.
	Processed prometheus.Counter
	// Duplicates counts deliveries acked without a new effect, by the layer
	// that caught them: "inbox" (message id recorded) or "version" (the
	// inbox's version gate, or the shipment, already had the event).
	Duplicates *prometheus.CounterVec
	// DeadLettered counts messages moved to the dead-letter queue, by reason.
	DeadLettered *prometheus.CounterVec
	// Deferred counts messages sent through the delay queue, by reason:
	// "gap" (an earlier version is missing), "in_progress", "retry" (the
	// handler failed), "transient" (the inbox's transaction kept failing
	// transiently, inbox.ErrTransient), "database" (the inbox failed on
	// another database error while MongoDB answers).
	Deferred *prometheus.CounterVec
	// UnknownType counts messages of an event type not handled here,
	// recorded as no-ops at their version.
	UnknownType prometheus.Counter
	// HandlerDuration observes the time to handle one delivery.
	HandlerDuration prometheus.Histogram
	// CommitToApplied observes, for each event applied, the time from its
	// outbox row's creation (in the orders transaction) to its effect here:
	// the service level indicator of docs/operations.md. Its buckets hold
	// the objective's 5 seconds; an observation made in a sampled trace
	// carries the trace id as an exemplar.
	CommitToApplied prometheus.Histogram
	// MongoUnavailable counts handling attempts paused because MongoDB did
	// not answer.
	MongoUnavailable prometheus.Counter
	// BrokerConnections counts successful connections to the broker
	// (1 + reconnections).
	BrokerConnections prometheus.Counter
	// Consuming is 1 while the consumer is consuming.
	Consuming prometheus.Gauge
	// PublisherBlocked is 1 while the broker blocks the connection that
	// publishes deferred and dead-lettered copies (a memory or disk alarm).
	PublisherBlocked prometheus.Gauge
	// BrokerNodes is amqp_nodes_configured, the broker nodes AMQP_URL lists
	// (3 on a cluster): the cluster's majority alert reads it, so a cluster
	// the consumers are configured for pages for as long as its nodes do
	// not answer, even after their scrape targets vanished. Set once.
	BrokerNodes prometheus.Gauge
	// RepublishTimeouts counts deferred or dead-lettered copies not
	// confirmed in time, whose delivery went back to the queue.
	RepublishTimeouts prometheus.Counter
	// Parked counts messages parked behind a dead letter of their order.
	Parked prometheus.Counter
	// HeldOrders, ParkedMessages, OldestParkedAge and DeadLetters show what
	// waits for an operator: orders held behind a dead letter, the messages
	// parked behind them, the age of the oldest, and the dead letters kept
	// for replay or discard. Refreshed periodically.
	HeldOrders, ParkedMessages, OldestParkedAge, DeadLetters prometheus.Gauge
}

// New creates the metrics and registers them on reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Processed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shipping_events_processed_total", Help: "Events whose effect was applied.",
		}),
		Duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shipping_events_duplicate_total", Help: "Deliveries acked without a new effect, by the layer that caught the duplicate (inbox, version).",
		}, []string{"layer"}),
		DeadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shipping_events_dead_lettered_total", Help: "Messages moved to the dead-letter queue, by reason.",
		}, []string{"reason"}),
		Deferred: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shipping_events_deferred_total", Help: "Messages sent through the delay queue, by reason (gap, in_progress, retry, transient, database).",
		}, []string{"reason"}),
		UnknownType: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shipping_events_unknown_type_total", Help: "Messages of an event type this service does not handle, recorded as no-ops at their version.",
		}),
		HandlerDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "shipping_handler_duration_seconds", Help: "Time to handle one delivery, from receipt to verdict.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		CommitToApplied: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "shipping_commit_to_applied_seconds",
			Help:    "Time from an event's outbox row creation to its effect in shipping, for each event applied.",
			Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, SLOSeconds, 10, 30, 60, 300, 900, 3600},
		}),
		MongoUnavailable: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shipping_mongo_unavailable_total", Help: "Handling attempts paused because MongoDB did not answer.",
		}),
		BrokerConnections: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shipping_broker_connections_total", Help: "Successful connections to the broker (first one and reconnections).",
		}),
		Consuming: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shipping_consumer_up", Help: "1 while the consumer is consuming from the broker.",
		}),
		PublisherBlocked: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shipping_publisher_blocked", Help: "1 while the broker blocks the connection publishing deferred and dead-lettered copies (a resource alarm).",
		}),
		RepublishTimeouts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shipping_republish_confirm_timeouts_total", Help: "Deferred or dead-lettered copies not confirmed in time; their deliveries went back to the queue.",
		}),
		Parked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shipping_events_parked_total", Help: "Messages parked behind a dead letter of their order.",
		}),
		HeldOrders: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shipping_parked_aggregates", Help: "Orders held behind a dead letter (their later versions are parked).",
		}),
		ParkedMessages: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shipping_parked_messages", Help: "Messages parked behind a dead letter of their order.",
		}),
		OldestParkedAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shipping_parked_oldest_age_seconds", Help: "Age of the oldest parked message (0: none).",
		}),
		DeadLetters: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shipping_dead_letters", Help: "Dead letters kept for an operator to replay or discard.",
		}),
		BrokerNodes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "amqp_nodes_configured", Help: "Broker nodes the process is configured with (the URLs in AMQP_URL).",
		}),
	}
	for _, c := range []prometheus.Collector{m.Processed, m.Duplicates, m.DeadLettered, m.Deferred, m.UnknownType,
		m.HandlerDuration, m.CommitToApplied, m.MongoUnavailable, m.BrokerConnections, m.Consuming, m.PublisherBlocked, m.RepublishTimeouts,
		m.Parked, m.HeldOrders, m.ParkedMessages, m.OldestParkedAge, m.DeadLetters, m.BrokerNodes} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	for _, l := range []string{"inbox", "version"} {
		m.Duplicates.WithLabelValues(l)
	}
	for _, r := range []string{"gap", "in_progress", "retry", "transient", "database"} {
		m.Deferred.WithLabelValues(r)
	}
	return m, nil
}

// ObserveCommitToApplied observes the time from created (the outbox row's
// creation) to now in CommitToApplied, with the trace id of the span in ctx
// as exemplar when that span is sampled, so a slow event leads to its
// trace. A negative time (clocks apart) counts as zero.
func (m *Metrics) ObserveCommitToApplied(ctx context.Context, created, now time.Time) {
	d := max(now.Sub(created), 0).Seconds()
	if sc := trace.SpanContextFromContext(ctx); sc.IsSampled() {
		if eo, ok := m.CommitToApplied.(prometheus.ExemplarObserver); ok {
			eo.ObserveWithExemplar(d, prometheus.Labels{"trace_id": sc.TraceID().String()})
			return
		}
	}
	m.CommitToApplied.Observe(d)
}

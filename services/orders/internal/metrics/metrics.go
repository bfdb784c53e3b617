// Package metrics exposes the orders service's outbox relay to Prometheus: the
// relay's counters and timings, and the backlog read from the outbox table at
// scrape time.
package metrics

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// Relay is an outbox.Observer that feeds Prometheus collectors.
type Relay struct {
	published      prometheus.Counter
	failed         prometheus.Counter
	returned       prometheus.Counter
	deadLettered   prometheus.Counter
	batchDuration  prometheus.Histogram
	confirmLatency prometheus.Histogram

	claimFailures    prometheus.Counter
	markFailures     prometheus.Counter
	unmarked         prometheus.Counter
	listenReconnects prometheus.Counter
	listenFallback   prometheus.Gauge
}

var _ outbox.Observer = (*Relay)(nil)

// NewRelay registers the relay's collectors on reg.
func NewRelay(reg prometheus.Registerer) *Relay {
	latencyBuckets := []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
	m := &Relay{
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_published_total", Help: "Messages the broker confirmed."}),
		failed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_failed_total", Help: "Publish attempts that did not end in a confirm (returned ones included)."}),
		returned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_returned_total", Help: "Messages the broker returned as unroutable."}),
		deadLettered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_dead_lettered_total", Help: "Rows that reached the maximum number of attempts."}),
		batchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_batch_duration_seconds", Help: "One relay batch, from claim to mark.", Buckets: latencyBuckets}),
		confirmLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_confirm_latency_seconds", Help: "Time for the broker to confirm a batch's slowest message.", Buckets: latencyBuckets}),
		claimFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_claim_failures_total", Help: "Claims that failed with a database error: nothing is published while they do."}),
		markFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_mark_failures_total", Help: "Statements recording a batch's outcome (mark published, record failures, record rows left unmarked) that failed with a database error."}),
		unmarked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_unmarked_total", Help: "Messages the broker confirmed that could not be marked published: each is published again after its lease."}),
		listenReconnects: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_listen_reconnects_total", Help: "Times the relay's LISTEN connection was lost (broken or silent) and reopened."}),
		listenFallback: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_listen_fallback", Help: "1 while the relay is configured to LISTEN but its own test notification did not arrive (e.g. LISTEN through a transaction-pooling PgBouncer; set OUTBOX_LISTEN_URL), so it relies on polling; 0 otherwise."}),
	}
	reg.MustRegister(m.published, m.failed, m.returned, m.deadLettered, m.batchDuration, m.confirmLatency,
		m.claimFailures, m.markFailures, m.unmarked, m.listenReconnects, m.listenFallback)
	return m
}

// Observe implements outbox.Observer. Kinds it does not know (the
// protocol points, the WAL relay's own) are ignored.
func (m *Relay) Observe(_ context.Context, o outbox.Observation) {
	switch o.Kind {
	case outbox.KindPublished:
		m.published.Add(float64(o.N))
	case outbox.KindFailed:
		m.failed.Add(float64(o.N))
	case outbox.KindReturned:
		m.returned.Add(float64(o.N))
	case outbox.KindDeadLettered:
		m.deadLettered.Add(float64(o.N))
	case outbox.KindBatchDuration:
		m.batchDuration.Observe(o.Duration.Seconds())
	case outbox.KindConfirmLatency:
		m.confirmLatency.Observe(o.Duration.Seconds())
	case outbox.KindClaimFailed:
		m.claimFailures.Inc()
	case outbox.KindMarkFailed:
		m.markFailures.Inc()
	case outbox.KindUnmarked:
		m.unmarked.Add(float64(o.N))
	case outbox.KindListenReconnected:
		m.listenReconnects.Inc()
	case outbox.KindListenFallback:
		v := 0.0
		if o.Fallback {
			v = 1
		}
		m.listenFallback.Set(v)
	}
}

// StatusReader reads the outbox backlog; *outboxadmin.Admin implements it.
type StatusReader interface {
	Status(ctx context.Context) (outboxadmin.Status, error)
}

// Backlog is a collector that reads the outbox backlog on every scrape.
type Backlog struct {
	status  StatusReader
	logger  *slog.Logger
	pending *prometheus.Desc
	dead    *prometheus.Desc
	oldest  *prometheus.Desc
	up      *prometheus.Desc
}

var _ prometheus.Collector = (*Backlog)(nil)

// NewBacklog returns a collector over status; register it on a registry.
func NewBacklog(status StatusReader, logger *slog.Logger) *Backlog {
	return &Backlog{
		status:  status,
		logger:  logger,
		pending: prometheus.NewDesc("outbox_pending", "Rows not published yet, dead letters excluded.", nil, nil),
		dead:    prometheus.NewDesc("outbox_dead_letters", "Rows dead-lettered and waiting for an operator.", nil, nil),
		oldest:  prometheus.NewDesc("outbox_oldest_pending_age_seconds", "Age of the oldest pending row, 0 when none.", nil, nil),
		up:      prometheus.NewDesc("outbox_status_up", "1 when the backlog could be read at this scrape.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (b *Backlog) Describe(ch chan<- *prometheus.Desc) {
	ch <- b.pending
	ch <- b.dead
	ch <- b.oldest
	ch <- b.up
}

// Collect implements prometheus.Collector.
func (b *Backlog) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	st, err := b.status.Status(ctx)
	if err != nil {
		b.logger.Warn("read outbox status for metrics", "error", err)
		ch <- prometheus.MustNewConstMetric(b.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(b.up, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(b.pending, prometheus.GaugeValue, float64(st.Pending))
	ch <- prometheus.MustNewConstMetric(b.dead, prometheus.GaugeValue, float64(st.DeadLettered))
	ch <- prometheus.MustNewConstMetric(b.oldest, prometheus.GaugeValue, st.OldestPendingAge.Seconds())
}

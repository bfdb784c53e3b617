package metrics

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// WALRelay collects, at scrape time, what only the WAL relay has: its
// replication slot's lag (read from PostgreSQL, so every process reports
// it, the waiting relays too) and the age of its oldest unconfirmed event.
type WALRelay struct {
	stats  func() outboxwal.Stats
	slot   func(context.Context) (outboxwal.SlotStatus, error)
	logger *slog.Logger

	lag, oldest, active, up *prometheus.Desc
}

var _ prometheus.Collector = (*WALRelay)(nil)

// NewWALRelay returns a collector over a relay's Stats and its slot's status.
func NewWALRelay(stats func() outboxwal.Stats, slot func(context.Context) (outboxwal.SlotStatus, error), logger *slog.Logger) *WALRelay {
	return &WALRelay{
		stats: stats, slot: slot, logger: logger,
		lag: prometheus.NewDesc("outbox_wal_slot_lag_bytes",
			"WAL the relay's replication slot retains behind the server's current position: not yet read and acknowledged. PostgreSQL keeps it on disk.", nil, nil),
		oldest: prometheus.NewDesc("outbox_wal_oldest_unconfirmed_age_seconds",
			"How long ago the oldest event this relay decoded and the broker has not confirmed yet committed; 0 when none (or when this relay is waiting).", nil, nil),
		active: prometheus.NewDesc("outbox_wal_relay_active", "1 while this relay streams from the slot, 0 while it waits for another relay to let go.", nil, nil),
		up:     prometheus.NewDesc("outbox_wal_slot_up", "1 when the slot exists and its status could be read at this scrape.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (w *WALRelay) Describe(ch chan<- *prometheus.Desc) {
	ch <- w.lag
	ch <- w.oldest
	ch <- w.active
	ch <- w.up
}

// Collect implements prometheus.Collector.
func (w *WALRelay) Collect(ch chan<- prometheus.Metric) {
	st := w.stats()
	active := 0.0
	if st.Active {
		active = 1
	}
	ch <- prometheus.MustNewConstMetric(w.active, prometheus.GaugeValue, active)
	ch <- prometheus.MustNewConstMetric(w.oldest, prometheus.GaugeValue, st.OldestUnconfirmedAge.Seconds())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s, err := w.slot(ctx)
	if err != nil || !s.Exists {
		if err != nil {
			w.logger.Warn("read the WAL relay's slot for metrics", "error", err)
		}
		ch <- prometheus.MustNewConstMetric(w.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(w.up, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(w.lag, prometheus.GaugeValue, float64(s.LagBytes))
}

package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
	"github.com/outbox-inbox/reference/services/orders/internal/metrics"
)

// relayRunner is what serve and the standalone relay need of a relay, polling
// or WAL.
type relayRunner interface {
	Run(ctx context.Context) error
	Wake()
}

// newRelayFor builds the relay RELAY_MODE chooses, and its publisher. The
// caller runs it and closes the publisher after the relay returned.
func newRelayFor(cfg config.Config, pool *pgxpool.Pool, reg prometheus.Registerer, crash *crashpoint.Trigger, logger *slog.Logger, tel *tracing.Telemetry) (relayRunner, *outboxamqp.Publisher, error) {
	if cfg.RelayMode != config.RelayModeWAL {
		return newRelay(cfg, pool, reg, crash, logger, tel)
	}
	walCfg := outboxwal.Config{
		Slot:             cfg.WALSlot,
		Publication:      cfg.WALSlot,
		BatchSize:        cfg.BatchSize,
		MaxInMemoryBytes: cfg.MaxInFlightBytes,
		PublishTimeout:   min(10*time.Second, cfg.Lease/3),
		MaxAttempts:      cfg.MaxAttempts,
		// Keep published events in outbox_published, as the polling relay
		// does (purged after OUTBOX_RETENTION): the audit trail, and what
		// the end-to-end checker compares the orders with.
		Archive: true,
		// The polling relay that publishes what the WAL relay hands over
		// (events whose publish failed, dead letters retried by an operator,
		// the events held behind them).
		Poll:     pollConfig(cfg),
		Logger:   logger,
		Observer: metrics.NewRelay(reg),
	}
	pub, err := newPublisher(cfg, reg, logger, "orders-relay-wal", outboxwal.DefaultWorkers*cfg.BatchSize) // one batch per worker
	if err != nil {
		return nil, nil, err
	}
	relay, err := outboxwal.NewRelay(pool, crashAfterConfirm(tracedPublisher(pub, tel), crash), walCfg)
	if err != nil {
		_ = pub.Close()
		return nil, nil, err
	}
	reg.MustRegister(metrics.NewWALRelay(relay.Stats, func(ctx context.Context) (outboxwal.SlotStatus, error) {
		return outboxwal.Slot(ctx, pool, cfg.WALSlot)
	}, logger))
	logger.Info("relay mode: WAL (logical replication)", "slot", cfg.WALSlot)
	return relay, pub, nil
}

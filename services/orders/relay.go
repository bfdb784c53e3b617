package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
	"github.com/outbox-inbox/reference/services/orders/internal/metrics"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
)

// newRelay builds the relay and its RabbitMQ publisher. The caller runs it and
// closes the publisher after the relay returned.
func newRelay(cfg config.Config, pool *pgxpool.Pool, reg prometheus.Registerer, crash *crashpoint.Trigger, logger *slog.Logger, tel *tracing.Telemetry) (*outbox.Relay, *outboxamqp.Publisher, error) {
	pub, err := newPublisher(cfg, reg, logger, "orders-relay", cfg.BatchSize) // one batch per channel
	if err != nil {
		return nil, nil, err
	}
	relayCfg := pollConfig(cfg)
	relayCfg.Logger = logger
	relayCfg.Observer = metrics.NewRelay(reg)
	if cfg.Listen {
		relayCfg.NotifyChannel = config.NotifyChannel
		if relayCfg.ListenConfig, err = postgres.ListenConfig(cfg.ListenURL); err != nil {
			_ = pub.Close()
			return nil, nil, err
		}
	}
	relay, err := outbox.NewRelay(pool, crashAfterConfirm(tracedPublisher(pub, tel), crash), relayCfg)
	if err != nil {
		_ = pub.Close()
		return nil, nil, err
	}
	return relay, pub, nil
}

// newPublisher builds a relay's RabbitMQ publisher, named connName, that
// confirms at most maxInFlight messages at once, and registers its
// readiness.
func newPublisher(cfg config.Config, reg prometheus.Registerer, logger *slog.Logger, connName string, maxInFlight int) (*outboxamqp.Publisher, error) {
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{
		URL:            cfg.AMQPURL,
		Exchange:       config.Exchange,
		ConnectionName: connName,
		MaxInFlight:    maxInFlight,
		Logger:         logger,
		CloudEvents:    cfg.CloudEvents(),
	})
	if err != nil {
		return nil, err
	}
	metrics.RegisterPublisherReady(reg, pub.Ready)
	metrics.RegisterBrokerNodes(reg, pub.Nodes())
	return pub, nil
}

// pollConfig is the polling relay's configuration from cfg, without its
// logger and observer: the relay's own, or the one under the WAL relay.
func pollConfig(cfg config.Config) outbox.RelayConfig {
	return outbox.RelayConfig{
		BatchSize:          cfg.BatchSize,
		MaxInFlightBytes:   cfg.MaxInFlightBytes,
		PollInterval:       cfg.PollInterval,
		Lease:              cfg.Lease,
		PublishTimeout:     min(10*time.Second, cfg.Lease/3),
		MaxAttempts:        cfg.MaxAttempts,
		RetryBackoffMin:    cfg.BackoffMin,
		RetryBackoffMax:    cfg.BackoffMax,
		PublishedRetention: cfg.Retention,
	}
}

// crashAfterConfirm wraps pub, and arms the crash point
// relay.after_publish_before_mark once the broker confirmed messages of a
// batch: the relay has them and has not marked them (the polling relay) or
// swept them (the WAL relay and its hand-over relay) yet.
func crashAfterConfirm(pub outbox.Publisher, crash *crashpoint.Trigger) outbox.Publisher {
	return confirmCrash{pub, crash}
}

type confirmCrash struct {
	outbox.Publisher
	crash *crashpoint.Trigger
}

func (p confirmCrash) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	errs := p.Publisher.PublishBatch(ctx, msgs)
	if slices.Contains(errs, nil) {
		p.crash.Hit(crashpoint.RelayAfterPublishBeforeMark)
	}
	return errs
}

// runRelay runs the relay alone, with /metrics, /healthz and /readyz on
// HTTP_ADDR when it is set (/healthz and /readyz from the start, while it
// waits for the database).
func runRelay(ctx context.Context, getenv func(string) string, logOut io.Writer, tel *tracing.Telemetry) error {
	cfg, err := config.FromEnv(getenv)
	if err != nil {
		return err
	}
	logger := newLogger(cfg, logOut).With("role", "relay")
	tel, stopTracing, err := setupTracing(ctx, tel, logger)
	if err != nil {
		return err
	}
	defer stopTracing()
	crash, err := crashpoint.FromEnv(getenv)
	if err != nil {
		return err
	}
	// Listen first: /healthz answers while the database is waited for.
	status := newStartupStatus()
	var srv *httpServer
	if getenv("HTTP_ADDR") != "" {
		if srv, err = startHTTP(ctx, cfg.HTTPAddr, startupHandler(status), logger); err != nil {
			return err
		}
		defer func() { _ = srv.Close() }() // a failed start; runAll stopped it otherwise
	}
	pool, err := relayDatabase(ctx, cfg, tel.TracerProvider, logger, status)
	if err != nil {
		return err
	}
	defer pool.Close()

	reg := newRegistry(pool, logger)
	relay, pub, err := newRelayFor(cfg, pool, reg, crash, logger, tel)
	if err != nil {
		return err
	}
	defer pub.Close()

	tasks := []func(context.Context) error{relay.Run}
	if srv != nil {
		srv.Handle(opsHandler(pool, reg, pub.Ready))
		tasks = append(tasks, srv.Run)
	}
	logger.InfoContext(ctx, "relay started", "exchange", config.Exchange)
	return runAll(ctx, tasks...)
}

// runAll runs every task until ctx ends or one fails; then it cancels the
// others, waits for all of them, and returns the first failure.
func runAll(ctx context.Context, tasks ...func(context.Context) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, len(tasks))
	for _, task := range tasks {
		go func() { errc <- task(ctx) }()
	}
	var first error
	for range tasks {
		if err := <-errc; err != nil && !errors.Is(err, context.Canceled) && first == nil {
			first = err
			cancel()
		}
	}
	return first
}

func outboxStatus(ctx context.Context, getenv func(string) string, stdout io.Writer) error {
	pool, err := openDatabase(ctx, getenv)
	if err != nil {
		return err
	}
	defer pool.Close()
	admin := outboxadmin.New(pool)
	st, err := admin.Status(ctx)
	if err != nil {
		return err
	}
	// pending_estimated: above outboxadmin.StatusCountLimit, pending is
	// PostgreSQL's running estimate of the table's rows, not a count.
	fmt.Fprintf(stdout, "pending=%d dead_lettered=%d oldest_pending_age=%s pending_estimated=%t\n",
		st.Pending, st.DeadLettered, st.OldestPendingAge.Round(time.Millisecond), st.PendingEstimated)
	return nil
}

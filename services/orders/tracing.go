package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxotel"
)

// setupTracing returns tel when the caller gave one (the tests, with an
// in-memory exporter), else the tracing the OTEL_* environment configures
// (see internal/tracing; off when nothing is configured), and a function that
// flushes it, to defer until everything that traces has stopped.
func setupTracing(ctx context.Context, tel *tracing.Telemetry, logger *slog.Logger) (*tracing.Telemetry, func(), error) {
	if tel != nil {
		return tel, func() {}, nil
	}
	tel, err := tracing.Setup(ctx, "orders", logger)
	if err != nil {
		return nil, nil, err
	}
	return tel, func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := tel.Shutdown(ctx); err != nil {
			logger.Warn("tracing: spans not flushed", "err", err)
		}
	}, nil
}

// What the publish spans learn from the RabbitMQ publisher: the exchange and
// routing keys, the node it is connected to (server.address, server.port),
// and when each message's confirm came (each span ends then).
var (
	_ outboxotel.Destinations = (*outboxamqp.Publisher)(nil)
	_ outboxotel.Server       = (*outboxamqp.Publisher)(nil)
	_ outboxotel.ConfirmTimer = (*outboxamqp.Publisher)(nil)
)

// tracedPublisher gives every publish of pub a producer span linked to the
// creation context stored with the event. With tracing off it passes
// batches through.
func tracedPublisher(pub *outboxamqp.Publisher, tel *tracing.Telemetry) outbox.Publisher {
	return outboxotel.NewPublisher(pub, outboxotel.Config{TracerProvider: tel.TracerProvider, Propagator: tel.Propagator})
}

// databaseTracer gives every PostgreSQL statement of a pool a CLIENT span
// (TRACE_DB=true): the claim, the marks, the inserts, under the span
// current when they run. Its metrics are off: the services' metrics are
// Prometheus's.
func databaseTracer(tp trace.TracerProvider) pgx.QueryTracer {
	return otelpgx.NewTracer(otelpgx.WithTracerProvider(tp), otelpgx.WithMeterProvider(metricnoop.NewMeterProvider()),
		otelpgx.WithTrimSQLInSpanName())
}

package main

import (
	"context"
	"log/slog"
	"time"

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

// tracedPublisher gives every publish of pub a producer span in the trace
// stored with the event, and sends that span's context in the AMQP headers.
// With tracing off it passes batches through.
func tracedPublisher(pub *outboxamqp.Publisher, tel *tracing.Telemetry) outbox.Publisher {
	return outboxotel.NewPublisher(pub, outboxotel.Config{TracerProvider: tel.TracerProvider, Propagator: tel.Propagator})
}

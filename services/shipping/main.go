// Command shipping consumes the order events and keeps one shipment per
// order, applying each event exactly once in effect and in order.
//
//	go run ./services/shipping
//	go run ./services/shipping dead-letters list|replay|discard   (the operator's CLI, see deadletters.go)
//
// Environment (defaults work against this machine's local services):
//
//	AMQP_URL     amqp://guest:guest@127.0.0.1:5672/   (the path is the vhost; on a
//	             cluster, the nodes' URLs separated by commas: docs/cluster.md)
//	MONGO_URI    mongodb://127.0.0.1:27017            (the path is the database, default "shipping")
//	HTTP_ADDR    127.0.0.1:8081
//	LOG_LEVEL    info (debug, info, warn, error)
//	ADMIN_TOKEN  unset: the /admin/dead-letters endpoints are off
//	INBOX_FLUSH_INTERVAL  10ms: inbox records are written in bulk at this interval
//	             where MongoDB has no transactions (0: each before its ack)
//	CRASH_POINT, CRASH_AFTER  arm a crash point (internal/crashpoint), for the e2e suite
//	OTEL_*       tracing, by the standard OpenTelemetry variables (internal/tracing):
//	             OTEL_EXPORTER_OTLP_ENDPOINT exports spans over OTLP (http/protobuf, or
//	             grpc with OTEL_EXPORTER_OTLP_PROTOCOL), OTEL_PROPAGATORS, OTEL_SERVICE_NAME
//	             (default "shipping"), OTEL_TRACES_SAMPLER...; unset, nothing is recorded
//	TRACE_DB     false: true gives every MongoDB command a span
//
// Flags override the topology names and tuning; see -h. Without a MongoDB
// server, `go run ./cmd/mongolocal` serves an embedded FerretDB on MONGO_URI.
// SIGINT or SIGTERM stops it gracefully: in-flight deliveries finish and are
// acked, the rest return to the queue.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/logfmt"
	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "shipping:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	if len(args) > 0 && args[0] == "dead-letters" {
		return deadLetters(ctx, args[1:], getenv, stdout)
	}
	cfg := app.Config{
		AdminToken: getenv("ADMIN_TOKEN"),
		AMQPURL:    cmp.Or(getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"),
		MongoURI:   cmp.Or(getenv("MONGO_URI"), "mongodb://127.0.0.1:27017"),
		HTTPAddr:   cmp.Or(getenv("HTTP_ADDR"), "127.0.0.1:8081"),
	}
	fs := flag.NewFlagSet("shipping", flag.ContinueOnError)
	fs.SetOutput(stdout)
	t := &cfg.Topology
	fs.StringVar(&t.Exchange, "exchange", "", "topic exchange of the order events (default orders.events)")
	fs.StringVar(&t.Queue, "queue", "", "quorum queue consumed (default shipping.order-events)")
	fs.StringVar(&t.BindingKey, "binding-key", "", "binding of the queue to the exchange (default order.*)")
	fs.StringVar(&t.DeadLetterExchange, "dead-letter-exchange", "", "dead-letter exchange (default shipping.dlx)")
	fs.StringVar(&t.DeadLetterQueue, "dead-letter-queue", "", "dead-letter queue (default <queue>.dlq)")
	fs.StringVar(&t.DelayQueue, "delay-queue", "", "delay queue for deferred messages (default <queue>.delay)")
	fs.DurationVar(&t.Delay, "delay", 0, "how long a deferred message waits (default 1s)")
	fs.IntVar(&t.DeliveryLimit, "delivery-limit", 0, "x-delivery-limit of the queue (default 20)")
	fs.IntVar(&cfg.Prefetch, "prefetch", 0, "consumer prefetch (default 32)")
	fs.IntVar(&cfg.Concurrency, "concurrency", 0, "deliveries handled at once (default 8)")
	fs.IntVar(&cfg.MaxAttempts, "max-attempts", 0, "handler failures before dead-lettering (default 5)")
	fs.IntVar(&cfg.MaxDeferrals, "max-deferrals", 0, "waits for an earlier version before dead-lettering (default 300)")
	fs.IntVar(&cfg.MaxTransientDeferrals, "max-transient-deferrals", 0, "deferrals after the inbox failed by itself before dead-lettering as inbox_failed (default 20)")
	fs.DurationVar(&cfg.MaxDeferralAge, "max-deferral-age", 0, "how long after its first deferral a message is dead-lettered instead of deferred again (default 30m)")
	fs.DurationVar(&cfg.ConfirmTimeout, "confirm-timeout", 0, "wait for the confirm of a deferred or dead-lettered copy before returning its delivery to the queue, and of a released or replayed message (default 30s)")
	fs.DurationVar(&cfg.StuckAfter, "stuck-after", 0, "time on one delivery after which a worker counts as stuck; /readyz is 503 while all are (default 1m)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}

	var level slog.Level
	if err := level.UnmarshalText([]byte(cmp.Or(getenv("LOG_LEVEL"), "info"))); err != nil {
		return fmt.Errorf("LOG_LEVEL: %w", err)
	}
	cfg.Logger = logfmt.New(stdout, level, "shipping")

	if v := strings.TrimSpace(getenv("INBOX_FLUSH_INTERVAL")); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return fmt.Errorf("INBOX_FLUSH_INTERVAL=%q: want a non-negative duration such as 10ms (0 writes each inbox record before its ack)", v)
		}
		cfg.InboxFlushInterval = d
		if d == 0 {
			cfg.InboxFlushInterval = -1 // app.Config: negative is synchronous, 0 the default
		}
	}

	crash, err := crashpoint.FromEnv(getenv)
	if err != nil {
		return err
	}
	cfg.Crash = crash

	tel, err := tracing.Setup(ctx, "shipping", cfg.Logger)
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := tel.Shutdown(sctx); err != nil {
			cfg.Logger.WarnContext(ctx, "tracing shutdown", "error", err)
		}
	}()
	cfg.TracerProvider, cfg.Propagator = tel.TracerProvider, tel.Propagator
	if v := strings.TrimSpace(getenv("TRACE_DB")); v != "" {
		if cfg.DatabaseSpans, err = strconv.ParseBool(v); err != nil {
			return fmt.Errorf("TRACE_DB=%q: want true or false", v)
		}
	}

	a, err := app.New(cfg)
	if err != nil {
		return err
	}
	cfg.Logger.InfoContext(ctx, "listening", "http_addr", a.HTTPAddr())
	return a.Run(ctx)
}

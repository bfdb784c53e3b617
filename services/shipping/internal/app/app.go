// Package app wires the shipping service: the RabbitMQ consumer, the
// processor, the inbox and the shipment store on MongoDB, and the HTTP API.
package app

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/x/mongo/driver/connstring"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/inboxotel"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
	"github.com/outbox-inbox/reference/services/shipping/internal/deadletter"
	"github.com/outbox-inbox/reference/services/shipping/internal/httpapi"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/processor"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Config configures the service.
type Config struct {
	// AMQPURL is the broker; its path is the vhost. Required.
	AMQPURL string
	// MongoURI is the MongoDB server; its path names the database
	// (default "shipping"). Required.
	MongoURI string
	// MongoServerSelectionTimeout bounds how long an operation waits for an
	// unreachable MongoDB before failing (and the delivery is held). Default: 5s.
	MongoServerSelectionTimeout time.Duration
	// HTTPAddr is where the HTTP API listens. Default: "127.0.0.1:8081".
	HTTPAddr string
	// Topology names the queues and exchanges (defaults in rabbitmq.Topology).
	Topology rabbitmq.Topology
	// Prefetch and Concurrency tune the consumer (defaults in rabbitmq.Config).
	Prefetch, Concurrency int
	// MaxAttempts and MaxDeferrals bound retries (defaults in processor.Config).
	MaxAttempts, MaxDeferrals int
	// MaxTransientDeferrals and MaxDeferralAge bound the deferrals of a
	// message the inbox fails on by itself, and every message's deferrals
	// by age (defaults in processor.Config: 20, 30m).
	MaxTransientDeferrals int
	MaxDeferralAge        time.Duration
	// StuckAfter is how long a worker may spend on one delivery before it
	// counts as stuck; /readyz answers 503 while every worker is (default in
	// rabbitmq.Config: 60s).
	StuckAfter time.Duration
	// ConfirmTimeout bounds the wait for the confirm of a deferred or
	// dead-lettered copy, after which its delivery goes back to the queue
	// (default in rabbitmq.Config: 30s), and of a released or replayed
	// message's re-publish (rabbitmq.ReplayPublisher, the same default).
	ConfirmTimeout time.Duration
	// InboxRetention keeps inbox records (default in inbox.Config: 7 days).
	InboxRetention time.Duration
	// InboxFlushInterval is the inbox's Standalone.FlushInterval: on a
	// server without transactions (FerretDB, a standalone mongod) each
	// delivery's done record is buffered and written in bulk at this
	// interval, instead of before the ack; a crash loses at most the records
	// of the last interval, which costs a rerun of the idempotent effect on a
	// redelivery. Not used on a replica set, where the record commits with the
	// effect. Default: 10ms; negative writes each record before the ack.
	InboxFlushInterval time.Duration
	// PurgeInterval is how often expired inbox records are purged where the
	// server has no TTL index. Default: inbox.DefaultPurgeInterval (1h: on
	// FerretDB each purge reads the whole inbox collection).
	PurgeInterval time.Duration
	// AdminToken is the bearer token of the /admin/dead-letters endpoints.
	// Default: "" (the admin endpoints are off).
	AdminToken string
	// DeadLetterStatsInterval is how often the dead-letter gauges (held
	// orders, parked messages, the oldest's age) are refreshed. Default: 15s.
	DeadLetterStatsInterval time.Duration
	// Crash arms the service's crash points. Default: nil (disarmed).
	Crash *crashpoint.Trigger
	// WrapStore, when set, wraps the shipment store (tests inject failures).
	WrapStore func(processor.Store) processor.Store
	// WrapInbox, when set, wraps the inbox (tests inject its failures).
	WrapInbox func(processor.Inbox) processor.Inbox
	// Logger. Default: discard.
	Logger *slog.Logger
	// TracerProvider traces each delivery: a CONSUMER span "process
	// <exchange>" linked to the context the message carries (and its child
	// while the event is young; see rabbitmq.ConsumerConfig.ParentMaxAge),
	// with the inbox check, the effect, the record, the ack and any
	// republished copy as its children. Default: a no-op provider (nothing
	// recorded; the trace context and baggage still pass through to the
	// copies).
	TracerProvider trace.TracerProvider
	// DatabaseSpans gives every MongoDB command run under a recording span a
	// CLIENT span (TRACE_DB=true). Default: false.
	DatabaseSpans bool
	// Propagator reads and writes the trace headers. Default: W3C Trace
	// Context and Baggage.
	Propagator propagation.TextMapPropagator
}

// The wiring plugs the adapters into the interfaces their consumers declare:
// the MongoDB store is the processor's Store, the dead-letter store and its
// releases the processor's DeadLetters and Releases and the HTTP API's
// DeadLetters, the processor the RabbitMQ consumer's Handler.
var (
	_ processor.Store       = (*mongodb.Store)(nil)
	_ processor.DeadLetters = (*deadletter.Store)(nil)
	_ processor.Releases    = (*deadletter.Manager)(nil)
	_ httpapi.DeadLetters   = (*deadletter.Manager)(nil)
	_ rabbitmq.Handler      = (*processor.Processor)(nil)
)

// App is a configured service; Run runs it.
type App struct {
	cfg       Config
	log       *slog.Logger
	client    *mongo.Client
	inbox     *inbox.Inbox
	store     *mongodb.Store
	dead      *deadletter.Store
	releases  *deadletter.Manager
	republish *rabbitmq.ReplayPublisher // the releases' publisher
	consumer  *rabbitmq.Consumer
	registry  *prometheus.Registry
	metrics   *metrics.Metrics
	listener  net.Listener
	server    *http.Server
}

// New builds the service and binds its HTTP listener. It does not need the
// broker or MongoDB to be up: Run waits for them.
func New(cfg Config) (*App, error) {
	if cfg.AMQPURL == "" || cfg.MongoURI == "" {
		return nil, errors.New("shipping: AMQPURL and MongoURI are required")
	}
	cfg.HTTPAddr = cmp.Or(cfg.HTTPAddr, "127.0.0.1:8081")
	cfg.PurgeInterval = cmp.Or(cfg.PurgeInterval, inbox.DefaultPurgeInterval)
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = noop.NewTracerProvider()
	}
	if cfg.Propagator == nil {
		cfg.Propagator = tracing.Propagator()
	}
	// With a no-op provider the inbox gets no hooks and the effect no span
	// wrapper: nothing is spent per message on tracing but reading the
	// delivery's trace headers.
	var traced *inboxotel.Tracing
	if _, off := cfg.TracerProvider.(noop.TracerProvider); !off {
		traced = inboxotel.New(cfg.TracerProvider)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cs, err := connstring.ParseAndValidate(cfg.MongoURI)
	if err != nil {
		return nil, fmt.Errorf("shipping: MONGO_URI: %w", err)
	}
	dbName := cmp.Or(cs.Database, "shipping")

	reg := prometheus.NewRegistry()
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		return nil, fmt.Errorf("shipping: register go collector: %w", err)
	}
	m, err := metrics.New(reg)
	if err != nil {
		return nil, fmt.Errorf("shipping: %w", err)
	}
	for _, r := range shipment.Reasons {
		m.DeadLettered.WithLabelValues(string(r))
	}
	nodes, err := amqpaddr.Parse(cfg.AMQPURL)
	if err != nil {
		return nil, fmt.Errorf("shipping: AMQP_URL: %w", err)
	}
	m.BrokerNodes.Set(float64(len(nodes)))

	clientOpts := options.Client().ApplyURI(cfg.MongoURI).
		SetServerSelectionTimeout(cmp.Or(cfg.MongoServerSelectionTimeout, 5*time.Second)).
		SetAppName("shipping")
	if cfg.DatabaseSpans && traced != nil {
		clientOpts.SetMonitor(mongodb.CommandMonitor(cfg.TracerProvider))
	}
	client, err := mongo.Connect(clientOpts)
	if err != nil {
		return nil, fmt.Errorf("shipping: MongoDB client: %w", err)
	}
	a := &App{cfg: cfg, log: log, client: client, registry: reg, metrics: m}
	fail := func(err error) (*App, error) {
		_ = client.Disconnect(context.Background())
		return nil, err
	}
	db := client.Database(dbName)
	flush := cmp.Or(cfg.InboxFlushInterval, 10*time.Millisecond)
	if flush < 0 {
		flush = 0 // synchronous records
	}
	var hooks inbox.Hooks
	if traced != nil {
		hooks = traced.Hooks()
	}
	if a.inbox, err = inbox.New(db, inbox.Config{
		Consumer: "shipping", Retention: cfg.InboxRetention, Logger: log, Hooks: hooks,
		// The outbox's message ids carry the event's creation time: an event
		// older than the retention is refused rather than applied again.
		MessageTime: mongodb.MessageTime,
		// Counts per minute of creation time, which cmd/audit -every reads
		// instead of looking each new event up.
		TallyBucket: time.Minute,
		// On a replica set the record commits with the effect instead.
		Standalone: inbox.StandaloneConfig{FlushInterval: flush},
	}); err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	// Each order's versions apply in order: the gate holds a version back
	// (inbox.ErrGap) until the one before it applied.
	gate, err := inbox.NewGate(a.inbox, inbox.GateConfig{})
	if err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	if a.store, err = mongodb.New(db, ""); err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	if a.dead, err = deadletter.NewStore(db); err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	var store processor.Store = a.store
	if cfg.WrapStore != nil {
		store = cfg.WrapStore(store)
	}
	var in processor.Inbox = gate
	if cfg.WrapInbox != nil {
		in = cfg.WrapInbox(in)
	}
	a.republish = &rabbitmq.ReplayPublisher{
		URL: cfg.AMQPURL, Queue: cfg.Topology.WithDefaults().Queue, ConfirmTimeout: cfg.ConfirmTimeout,
		TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator,
	}
	a.releases, err = deadletter.NewManager(deadletter.Config{
		Store:     a.dead,
		Publisher: a.republish,
		Skipper:   skipper{store: a.store, gate: gate},
		Crash:     cfg.Crash,
		Logger:    log,
	})
	if err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	proc, err := processor.New(processor.Config{
		Inbox: in, Store: store, Metrics: m, DeadLetters: a.dead, Releases: a.releases,
		MaxAttempts: cfg.MaxAttempts, MaxDeferrals: cfg.MaxDeferrals,
		MaxTransientDeferrals: cfg.MaxTransientDeferrals, MaxDeferralAge: cfg.MaxDeferralAge,
		Crash: cfg.Crash, Logger: log, Tracing: traced,
	})
	if err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	a.consumer, err = rabbitmq.New(rabbitmq.Config{
		URL: cfg.AMQPURL, Topology: cfg.Topology,
		Prefetch: cfg.Prefetch, Concurrency: cfg.Concurrency, StuckAfter: cfg.StuckAfter, ConfirmTimeout: cfg.ConfirmTimeout,
		Metrics: m, Logger: log,
		TracerProvider: cfg.TracerProvider, Propagator: cfg.Propagator,
	}, proc)
	if err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	h, err := httpapi.New(httpapi.Config{
		Shipments: a.store,
		Checks: map[string]httpapi.Check{
			"mongodb": a.store.Ping,
			"broker":  func(context.Context) error { return a.consumer.Ready() },
			"workers": func(context.Context) error { return a.consumer.Working() },
		},
		Gatherer:    reg,
		Logger:      log,
		DeadLetters: a.releases,
		AdminToken:  cfg.AdminToken,
	})
	if err != nil {
		return fail(fmt.Errorf("shipping: %w", err))
	}
	a.listener, err = net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return fail(fmt.Errorf("shipping: listen on %s: %w", cfg.HTTPAddr, err))
	}
	a.server = &http.Server{
		Handler:           http.MaxBytesHandler(serverSpans(h, cfg.TracerProvider, cfg.Propagator), 1<<16),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       time.Minute,
	}
	return a, nil
}

// serverSpans wraps the HTTP API in a server span per request (otelhttp),
// the probes and the metrics scrape aside; a no-op provider leaves h as it
// is. An operator's replay of a dead letter links its publish span to the
// request's.
func serverSpans(h http.Handler, tp trace.TracerProvider, prop propagation.TextMapPropagator) http.Handler {
	if _, off := tp.(noop.TracerProvider); off {
		return h
	}
	return otelhttp.NewHandler(h, "shipping",
		otelhttp.WithTracerProvider(tp),
		otelhttp.WithPropagators(prop),
		otelhttp.WithMeterProvider(metricnoop.NewMeterProvider()), // the metrics are Prometheus's
		otelhttp.WithFilter(func(r *http.Request) bool {
			switch r.URL.Path {
			case "/healthz", "/readyz", "/metrics":
				return false
			}
			return true
		}),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return r.Method }),
	)
}

// HTTPAddr is the address the HTTP API listens on.
func (a *App) HTTPAddr() string { return a.listener.Addr().String() }

// Topology is the RabbitMQ topology in use.
func (a *App) Topology() rabbitmq.Topology { return a.consumer.Topology() }

// Ready reports whether the consumer is consuming.
func (a *App) Ready() error { return a.consumer.Ready() }

// Metrics exposes the service's metrics (tests read them).
func (a *App) Metrics() *metrics.Metrics { return a.metrics }

// Run serves until ctx ends, then shuts down gracefully: the HTTP server
// stops, in-flight deliveries finish and are acked, the inbox writes its
// buffered records, MongoDB is disconnected.
func (a *App) Run(parent context.Context) error {
	ctx, stop := context.WithCancel(parent)
	defer stop()
	a.log.InfoContext(ctx, "shipping service starting", "http_addr", a.HTTPAddr(),
		"queue", a.consumer.Topology().Queue, "exchange", a.consumer.Topology().Exchange,
		"effect_log_writer", a.store.Writer().String())

	var wg sync.WaitGroup
	errc := make(chan error, 1)
	wg.Go(func() {
		if err := a.server.Serve(a.listener); err != nil && !errors.Is(err, http.ErrServerClosed) {
			select {
			case errc <- fmt.Errorf("http server: %w", err):
			default:
			}
		}
	})
	wg.Go(func() { a.maintainInbox(ctx) })
	wg.Go(func() { a.refreshDeadLetterStats(ctx) })
	consumerDone := make(chan struct{})
	wg.Go(func() {
		defer close(consumerDone)
		_ = a.consumer.Run(ctx) // returns nil when ctx ends
	})

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
		stop()
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	if err := a.server.Shutdown(sctx); err != nil {
		a.log.WarnContext(ctx, "http shutdown", "error", err)
	}
	wg.Wait()
	<-consumerDone
	// The consumer acks no more: write the inbox records it buffered. Those
	// not written in time are lost, which only costs a rerun of the
	// idempotent effect if their messages come again.
	if err := a.inbox.Close(sctx); err != nil {
		a.log.WarnContext(ctx, "inbox close", "error", err)
	}
	if err := a.republish.Close(); err != nil {
		a.log.WarnContext(ctx, "dead-letter republisher close", "error", err)
	}
	if err := a.client.Disconnect(sctx); err != nil {
		a.log.WarnContext(ctx, "MongoDB disconnect", "error", err)
	}
	a.log.InfoContext(ctx, "shipping service stopped")
	return runErr
}

// refreshDeadLetterStats keeps the dead-letter gauges current. First it
// creates the dead-letter collections' indexes and finishes the releases of
// dead letters that a crash interrupted (retrying at each tick until
// MongoDB and the broker answer).
func (a *App) refreshDeadLetterStats(ctx context.Context) {
	t := time.NewTicker(cmp.Or(a.cfg.DeadLetterStatsInterval, 15*time.Second))
	defer t.Stop()
	indexed, resumed := false, false
	for {
		if !indexed {
			ictx, cancel := context.WithTimeout(ctx, time.Minute)
			err := a.dead.EnsureIndexes(ictx)
			cancel()
			switch {
			case err == nil:
				indexed = true
			case ctx.Err() == nil:
				a.log.WarnContext(ctx, "dead-letter indexes not created yet, retrying", "error", err)
			}
		}
		if !resumed {
			rctx, cancel := context.WithTimeout(ctx, time.Minute)
			n, err := a.releases.Resume(rctx)
			cancel()
			switch {
			case err == nil:
				resumed = true
				if n > 0 {
					a.log.InfoContext(ctx, "interrupted dead-letter releases finished", "count", n)
				}
			case ctx.Err() == nil:
				a.log.WarnContext(ctx, "could not finish interrupted dead-letter releases yet", "error", err)
			}
		}
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		st, err := a.dead.Stats(sctx, time.Now())
		cancel()
		if err == nil {
			a.metrics.HeldOrders.Set(float64(st.HeldOrders))
			a.metrics.ParkedMessages.Set(float64(st.Parked))
			a.metrics.OldestParkedAge.Set(st.OldestParkedAge.Seconds())
			a.metrics.DeadLetters.Set(float64(st.DeadLetters))
		} else if ctx.Err() == nil {
			a.log.DebugContext(ctx, "dead-letter stats", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// maintainInbox creates the inbox's index (retrying until MongoDB answers),
// then purges expired records where the server has no TTL index.
func (a *App) maintainInbox(ctx context.Context) {
	for attempt := 1; ; attempt++ {
		ictx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := a.inbox.EnsureIndexes(ictx)
		cancel()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		a.log.WarnContext(ctx, "inbox indexes not created yet, retrying", "error", err, "attempt", attempt)
		t := time.NewTimer(min(time.Duration(attempt)*time.Second, 30*time.Second))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
	if !a.inbox.TTL() {
		_ = a.inbox.RunPurger(ctx, a.cfg.PurgeInterval)
	}
}

// skipper discards a version: in the shipment first, then in the inbox's
// gate, which lets the versions after it through (a discard resumed after a
// crash in between repeats both; each is idempotent).
type skipper struct {
	store *mongodb.Store
	gate  *inbox.Gate
}

func (s skipper) Skip(ctx context.Context, orderID string, version int64, messageID, eventType string) error {
	if err := s.store.Skip(ctx, orderID, version, messageID, eventType); err != nil {
		return err
	}
	if err := s.gate.Skip(ctx, inbox.Position{Aggregate: orderID, Version: version}, cmp.Or(messageID, "discarded")); err != nil {
		return fmt.Errorf("discard shipment %s version %d in the inbox's gate: %w", orderID, version, err)
	}
	return nil
}

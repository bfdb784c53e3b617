package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/logfmt"
	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
	"github.com/outbox-inbox/reference/services/orders/internal/httpapi"
	"github.com/outbox-inbox/reference/services/orders/internal/metrics"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
)

func newLogger(cfg config.Config, w io.Writer) *slog.Logger {
	return logfmt.New(w, cfg.LogLevel, "orders")
}

func serve(ctx context.Context, getenv func(string) string, logOut io.Writer, tel *tracing.Telemetry) error {
	cfg, err := config.FromEnv(getenv)
	if err != nil {
		return err
	}
	logger := newLogger(cfg, logOut)
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
	srv, err := startHTTP(ctx, cfg.HTTPAddr, startupHandler(status), logger)
	if err != nil {
		return err
	}
	defer func() { _ = srv.Close() }() // a failed start; runAll stopped it otherwise
	pool, err := serveDatabase(ctx, cfg, tel.TracerProvider, logger, status)
	if err != nil {
		return err
	}
	defer pool.Close()

	writerCfg := outbox.WriterConfig{}
	if cfg.Notify {
		writerCfg.NotifyChannel = config.NotifyChannel
	}
	writer, err := outbox.NewWriter(writerCfg)
	if err != nil {
		return err
	}
	store := postgres.NewStore(pool, postgres.StoreConfig{
		Writer: writer, TracerProvider: tel.TracerProvider, Propagator: tel.Propagator,
		EventDestination: config.Exchange, BaggageKeys: cfg.Tracing.BaggageKeys, BaggageMaxBytes: cfg.Tracing.BaggageMaxBytes,
	})

	reg := newRegistry(pool, logger)
	tasks := []func(context.Context) error{}
	var wake func()
	if cfg.Relay {
		relay, pub, err := newRelayFor(cfg, pool, reg, crash, logger.With("role", "relay"), tel)
		if err != nil {
			return err
		}
		defer pub.Close()
		tasks = append(tasks, relay.Run)
		wake = relay.Wake
	}
	api, err := httpapi.New(httpapi.Config{
		Orders:     countedOrders{Orders: store, m: metrics.NewOrders(reg)},
		Outbox:     outboxadmin.New(pool),
		AdminToken: cfg.AdminToken,
		Wake:       wake,
		Metrics:    promhttp.HandlerFor(reg, promhttp.HandlerOpts{}),
		Requests:   metrics.NewRequests(reg),
		Crash:      crash,
		Logger:     logger,

		TracerProvider:    tel.TracerProvider,
		Propagator:        tel.Propagator,
		TrustTraceContext: func(r *http.Request) bool { return cfg.Tracing.TrustedPeers.Contains(r.RemoteAddr) },
	})
	if err != nil {
		return err
	}
	srv.Handle(api)
	tasks = append(tasks, srv.Run)
	return runAll(ctx, tasks...)
}

// newRegistry returns the Prometheus registry of a process: runtime metrics and
// the outbox backlog.
func newRegistry(pool *pgxpool.Pool, logger *slog.Logger) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		metrics.NewBacklog(outboxadmin.New(pool), logger),
	)
	return reg
}

// opsHandler serves /healthz, /readyz and /metrics for the standalone relay.
// /readyz answers 503 with a JSON body naming what is down: "database" when a
// ping fails, "broker" when broker (the publisher's Ready) reports an error.
func opsHandler(pool *pgxpool.Pool, reg *prometheus.Registry, broker func() error) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"ok"}` + "\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		body := map[string]string{"status": "ready"}
		if err := pool.Ping(ctx); err != nil {
			body["database"] = err.Error()
		}
		if err := broker(); err != nil {
			body["broker"] = err.Error()
		}
		w.Header().Set("Content-Type", "application/json")
		if len(body) > 1 {
			body["status"] = "unavailable"
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}

// serveHTTP serves h on ln until ctx ends, then drains in-flight requests.
func serveHTTP(ctx context.Context, ln net.Listener, h http.Handler, logger *slog.Logger) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		BaseContext:       func(net.Listener) context.Context { return context.WithoutCancel(ctx) },
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	logger.InfoContext(ctx, "http listening", "addr", ln.Addr().String())

	select {
	case err := <-errc:
		return fmt.Errorf("http server: %w", err)
	case <-ctx.Done():
	}
	logger.Info("shutting down http server")
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		return fmt.Errorf("http shutdown: %w", err)
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("http server: %w", err)
	}
	return nil
}

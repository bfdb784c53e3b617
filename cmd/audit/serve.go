package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outbox-inbox/reference/internal/audit"
)

// metrics are the gauges of the continuous mode (deploy/prometheus/rules/audit.yml
// alerts on them).
type metrics struct {
	events      *prometheus.GaugeVec
	checked     prometheus.Gauge
	lastSuccess prometheus.Gauge
	duration    prometheus.Gauge
	runs        *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		events: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "audit_events", Help: "Events of the last audit's window, by bucket (applied, unrecorded, missing, phantom, pending, dead_lettered, discarded, held; applied_before_window counts inbox records).",
		}, []string{"bucket"}),
		checked: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "audit_checked_events", Help: "Committed events the last audit judged.",
		}),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "audit_last_success_timestamp_seconds", Help: "When the last audit that completed started (Unix time).",
		}),
		duration: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "audit_duration_seconds", Help: "How long the last completed audit took.",
		}),
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "audit_runs_total", Help: "Audits run, by result: whole, not_whole, error.",
		}, []string{"result"}),
	}
	// process_start_time_seconds among them: AuditNotRunning counts from the
	// process's start until its first audit completes.
	process := collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})
	for _, c := range []prometheus.Collector{m.events, m.checked, m.lastSuccess, m.duration, m.runs, process} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	for _, r := range []string{"whole", "not_whole", "error"} {
		m.runs.WithLabelValues(r)
	}
	return m, nil
}

func (m *metrics) record(r *audit.Report) {
	for name, b := range r.Buckets() {
		m.events.WithLabelValues(name).Set(float64(b.Count))
	}
	m.checked.Set(float64(r.Checked))
	m.lastSuccess.Set(float64(r.AuditedAt.UnixNano()) / 1e9)
	m.duration.Set(r.Seconds)
}

// serve audits every opts.every until ctx ends, serving the last result:
// GET /metrics (Prometheus), GET /report (the last report as JSON), GET
// /healthz.
func (a *auditor) serve(ctx context.Context, log *slog.Logger) error {
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg)
	if err != nil {
		return err
	}
	var last atomic.Pointer[[]byte]
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /report", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		body := last.Load()
		if body == nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"error":"no audit has completed yet"}` + "\n"))
			return
		}
		_, _ = w.Write(*body)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"ok"}` + "\n"))
	})
	ln, err := net.Listen("tcp", a.opts.metricsAddr)
	if err != nil {
		return fmt.Errorf("listen on -metrics-addr: %w", err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	log.InfoContext(ctx, "listening", "metrics_addr", ln.Addr().String(), "every", a.opts.every)

	t := time.NewTicker(a.opts.every)
	defer t.Stop()
	for {
		a.once(ctx, log, m, &last)
		select {
		case <-ctx.Done():
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := srv.Shutdown(sctx); err != nil {
				return fmt.Errorf("stop the metrics server: %w", err)
			}
			if err := <-served; !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("metrics server: %w", err)
			}
			log.InfoContext(ctx, "stopped")
			return nil
		case err := <-served:
			return fmt.Errorf("metrics server: %w", err)
		case <-t.C:
		}
	}
}

// once runs one audit of the continuous mode and records its outcome.
func (a *auditor) once(ctx context.Context, log *slog.Logger, m *metrics, last *atomic.Pointer[[]byte]) {
	r, err := a.audit(ctx, time.Now())
	switch {
	case ctx.Err() != nil:
		return
	case err != nil:
		m.runs.WithLabelValues("error").Inc()
		log.ErrorContext(ctx, "audit failed", "error", err)
		return
	}
	m.record(r)
	if body, err := json.Marshal(r); err == nil {
		body = append(body, '\n')
		last.Store(&body)
	}
	attrs := []any{"since", r.Since, "until", r.Until, "checked", r.Checked, "duration", time.Duration(r.Seconds * float64(time.Second))}
	names := make([]string, 0, 8)
	for name := range r.Buckets() {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		attrs = append(attrs, name, r.Buckets()[name].Count)
	}
	if r.Whole() {
		m.runs.WithLabelValues("whole").Inc()
		log.InfoContext(ctx, "audit: the flow is whole", attrs...)
		return
	}
	m.runs.WithLabelValues("not_whole").Inc()
	log.ErrorContext(ctx, "audit: the flow is not whole", append(attrs, "missing_examples", r.Missing.Examples, "phantom_examples", r.Phantom.Examples)...)
}

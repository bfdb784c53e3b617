// Package httpapi serves the shipping service's HTTP endpoints:
//
//	GET /shipments/{order_id}  the shipment, with every event applied to it, in order
//	GET /healthz               the process is up
//	GET /readyz                MongoDB and the broker consumer are usable, and not every worker is stuck
//	GET /metrics               Prometheus metrics
//
// and, with an AdminToken and DeadLetters, the operator's endpoints under
// /admin/dead-letters (see mountAdmin).
package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Shipments reads shipments.
type Shipments interface {
	Get(ctx context.Context, orderID string) (shipment.Shipment, error)
}

// Check is one readiness dependency: nil when usable.
type Check func(ctx context.Context) error

// Config configures the handler.
type Config struct {
	Shipments Shipments           // required
	Checks    map[string]Check    // readiness checks by name, e.g. "mongodb", "broker"
	Gatherer  prometheus.Gatherer // required: what /metrics serves
	Logger    *slog.Logger        // default: discard
	// DeadLetters backs the /admin/dead-letters endpoints. Default: nil
	// (endpoints off).
	DeadLetters DeadLetters
	// AdminToken is the bearer token the /admin endpoints require. Default:
	// "" (the admin endpoints are off and answer 404).
	AdminToken string
}

// New returns the service's HTTP handler.
func New(cfg Config) (http.Handler, error) {
	if cfg.Shipments == nil || cfg.Gatherer == nil {
		return nil, errors.New("httpapi: Shipments and Gatherer are required")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &api{cfg: cfg, log: log}
	r := chi.NewRouter()
	r.Get("/shipments/{order_id}", a.getShipment)
	r.Get("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	r.Get("/readyz", a.ready)
	// OpenMetrics when asked for (Prometheus asks): the only format that
	// carries the commit-to-applied histogram's exemplars.
	r.Handle("/metrics", promhttp.HandlerFor(cfg.Gatherer, promhttp.HandlerOpts{EnableOpenMetrics: true}))
	if cfg.DeadLetters != nil && cfg.AdminToken != "" {
		a.mountAdmin(r)
	}
	r.NotFound(func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusNotFound, "not found")
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusMethodNotAllowed, "method not allowed")
	})
	return r, nil
}

type api struct {
	cfg Config
	log *slog.Logger
}

func (a *api) getShipment(w http.ResponseWriter, r *http.Request) {
	id := chi.URLParam(r, "order_id")
	if id == "" || len(id) > 200 {
		writeError(w, http.StatusBadRequest, "order_id: want 1 to 200 bytes")
		return
	}
	s, err := a.cfg.Shipments.Get(r.Context(), id)
	switch {
	case errors.Is(err, shipment.ErrNotFound):
		writeError(w, http.StatusNotFound, "shipment not found")
	case err != nil:
		a.log.ErrorContext(r.Context(), "get shipment", "aggregate_id", id, "error", err)
		writeError(w, http.StatusServiceUnavailable, "shipments are unavailable")
	default:
		writeJSON(w, http.StatusOK, s)
	}
}

func (a *api) ready(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	status, checks := http.StatusOK, map[string]string{}
	for name, check := range a.cfg.Checks {
		if err := check(ctx); err != nil {
			status, checks[name] = http.StatusServiceUnavailable, err.Error()
			continue
		}
		checks[name] = "ok"
	}
	state := "ready"
	if status != http.StatusOK {
		state = "not ready"
	}
	writeJSON(w, status, map[string]any{"status": state, "checks": checks})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]string{"error": msg})
}

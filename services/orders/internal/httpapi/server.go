// Package httpapi is the orders service's HTTP API: orders, health, metrics and
// the operator's outbox endpoints.
package httpapi

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"reflect"
	"regexp"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/services/orders/internal/order"
)

// MaxBodyBytes bounds a request body; a larger one gets 413.
const MaxBodyBytes = 64 << 10

// Orders is what the API needs from the order store. Create, Amend and Cancel store
// the trace context of ctx (the request's span, or the client's context with
// tracing off) with the event; headers are extra event headers (the API gives
// none).
type Orders interface {
	Create(ctx context.Context, n order.NewOrder, idem order.Idempotency, headers map[string]string) (order.Order, bool, error)
	Get(ctx context.Context, id string) (order.Order, error)
	Cancel(ctx context.Context, id string, headers map[string]string) (order.Order, bool, error)
	// Amend makes the order's next version with a's note, once per
	// idempotency key (true: an amendment already made under the key).
	Amend(ctx context.Context, id string, a order.NewAmendment, idem order.Idempotency, headers map[string]string) (order.Amendment, bool, error)
	Ping(ctx context.Context) error
}

// Config configures a Server.
type Config struct {
	// Orders stores orders. Required.
	Orders Orders
	// Outbox backs the /admin/outbox endpoints. Default: nil (endpoints off).
	Outbox OutboxAdmin
	// AdminToken is the bearer token the /admin endpoints require. Default: ""
	// (the admin endpoints are off and answer 404).
	AdminToken string
	// Wake is called after a transaction that enqueued events committed, so an
	// in-process relay publishes them at once. Default: nil.
	Wake func()
	// Metrics serves /metrics. Default: nil (404).
	Metrics http.Handler
	// Requests records every request answered, by route pattern. Default:
	// nil (not recorded).
	Requests RequestObserver
	// Crash kills the process at named points for the e2e suite. Default: nil.
	Crash *crashpoint.Trigger
	// Logger. Default: slog.Default().
	Logger *slog.Logger
	// TracerProvider starts the server spans. Default: a no-op provider
	// (tracing off: the client's trace context is still carried into the
	// events).
	TracerProvider trace.TracerProvider
	// Propagator reads the client's trace context and baggage. Default: W3C
	// Trace Context and Baggage.
	Propagator propagation.TextMapPropagator
	// TrustTraceContext says whether a request's caller is trusted with its
	// trace context and baggage (see traced). Default: every caller is.
	TrustTraceContext func(*http.Request) bool
}

// Server is the orders HTTP API.
type Server struct {
	orders     Orders
	outbox     OutboxAdmin
	adminToken string
	wake       func()
	crash      *crashpoint.Trigger
	logger     *slog.Logger
	handler    http.Handler
}

// New returns a Server for cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Orders == nil {
		return nil, errors.New("httpapi: Config.Orders is required")
	}
	s := &Server{
		orders:     cfg.Orders,
		outbox:     cfg.Outbox,
		adminToken: cfg.AdminToken,
		wake:       cfg.Wake,
		crash:      cfg.Crash,
		logger:     cfg.Logger,
	}
	if s.logger == nil {
		s.logger = slog.Default()
	}
	if s.wake == nil {
		s.wake = func() {}
	}
	r := chi.NewRouter()
	if cfg.Requests != nil {
		r.Use(measured(cfg.Requests))
	}
	r.Use(nameByRoute)
	r.NotFound(func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, &apiError{http.StatusNotFound, "not_found", "no such endpoint"})
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, &apiError{http.StatusMethodNotAllowed, "method_not_allowed", r.Method + " is not allowed here"})
	})
	r.Post("/orders", s.handle(s.createOrder))
	r.Get("/orders/{id}", s.handle(s.getOrder))
	r.Post("/orders/{id}/cancel", s.handle(s.cancelOrder))
	r.Post("/orders/{id}/amendments", s.handle(s.amendOrder))
	r.Get("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	r.Get("/readyz", s.readyz)
	if cfg.Metrics != nil {
		r.Method(http.MethodGet, "/metrics", cfg.Metrics)
	}
	if s.outbox != nil && s.adminToken != "" {
		s.mountAdmin(r)
	}
	tp, prop := cfg.TracerProvider, cfg.Propagator
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	trust := cfg.TrustTraceContext
	if trust == nil {
		trust = func(*http.Request) bool { return true }
	}
	s.handler = traced(r, tp, prop, trust)
	return s, nil
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// handle adapts a handler that returns an error to http.HandlerFunc.
func (s *Server) handle(h func(w http.ResponseWriter, r *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			s.writeError(w, r, err)
		}
	}
}

func (s *Server) createOrder(w http.ResponseWriter, r *http.Request) error {
	var req order.CreateRequest
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	var idem order.Idempotency
	if key, ok := r.Header["Idempotency-Key"]; ok {
		if len(key) != 1 {
			return badRequest("invalid_header", "send one Idempotency-Key header")
		}
		if err := order.CheckIdempotencyKey(key[0]); err != nil {
			return err
		}
		idem.Key = key[0]
	}
	n, err := req.Validate()
	if err != nil {
		return err
	}
	if idem.Key != "" {
		idem.RequestHash = requestHash(n)
	}
	o, replayed, err := s.orders.Create(r.Context(), n, idem, nil)
	if err != nil {
		return err
	}
	if !replayed {
		s.wake()
		s.logger.InfoContext(r.Context(), "order created", orderAttrs(o)...)
	}
	s.crash.Hit(crashpoint.OrdersAfterCommitBeforeResponse)
	w.Header().Set("Location", "/orders/"+o.ID)
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	writeJSON(w, http.StatusCreated, o)
	return nil
}

var uuidPattern = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

func orderID(r *http.Request) (string, error) {
	id := chi.URLParam(r, "id")
	if !uuidPattern.MatchString(id) {
		return "", badRequest("invalid_id", "order id must be a UUID")
	}
	return strings.ToLower(id), nil
}

func (s *Server) getOrder(w http.ResponseWriter, r *http.Request) error {
	id, err := orderID(r)
	if err != nil {
		return err
	}
	o, err := s.orders.Get(r.Context(), id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, o)
	return nil
}

func (s *Server) cancelOrder(w http.ResponseWriter, r *http.Request) error {
	id, err := orderID(r)
	if err != nil {
		return err
	}
	o, changed, err := s.orders.Cancel(r.Context(), id, nil)
	if err != nil {
		return err
	}
	if changed {
		s.wake()
		s.logger.InfoContext(r.Context(), "order cancelled", orderAttrs(o)...)
	}
	writeJSON(w, http.StatusOK, o)
	return nil
}

// amendOrder makes the order's next version (an order.amended event). The
// Idempotency-Key is required: a client that does not know whether its
// amendment committed sends it again with the same key and gets the version
// it made (Idempotent-Replayed: true), never a second one.
func (s *Server) amendOrder(w http.ResponseWriter, r *http.Request) error {
	id, err := orderID(r)
	if err != nil {
		return err
	}
	key, err := order.RequireIdempotencyKey(r.Header.Values("Idempotency-Key"))
	if err != nil {
		return err
	}
	var req order.AmendRequest
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	a, err := req.Validate()
	if err != nil {
		return err
	}
	am, replayed, err := s.orders.Amend(r.Context(), id, a, order.Idempotency{Key: key, RequestHash: requestHash(a)}, nil)
	if err != nil {
		return err
	}
	if !replayed {
		s.wake()
		s.logger.InfoContext(r.Context(), "order amended", "aggregate_id", am.OrderID, "version", am.Version)
	}
	s.crash.Hit(crashpoint.OrdersAfterCommitBeforeResponse)
	w.Header().Set("Location", "/orders/"+am.OrderID)
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	writeJSON(w, http.StatusCreated, am)
	return nil
}

func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := s.orders.Ping(ctx); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "unavailable", "database": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// decodeJSON reads exactly one JSON object from r's body into v, strictly:
// JSON content type, bounded size, no unknown fields, nothing after the object.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any) error {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "application/json" {
		return &apiError{http.StatusUnsupportedMediaType, "unsupported_media_type", "Content-Type must be application/json"}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		return &apiError{http.StatusRequestEntityTooLarge, "body_too_large", fmt.Sprintf("body exceeds %d bytes", MaxBodyBytes)}
	}
	if err != nil {
		return badRequest("unreadable_body", "could not read body: "+err.Error())
	}
	if len(strings.TrimSpace(string(body))) == 0 {
		return badRequest("empty_body", "body is empty")
	}
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) && typeErr.Field != "" && typeErr.Type.Kind() == reflect.Int64 {
			// A number out of range, a fraction, or a string where an integer goes.
			return &order.ValidationError{Field: typeErr.Field, Message: "must be an integer in range, got " + typeErr.Value}
		}
		return badRequest("invalid_json", "invalid JSON body: "+err.Error())
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return badRequest("trailing_data", "body has data after the JSON object")
	}
	return nil
}

// requestHash identifies a request (a create's NewOrder, an amendment's
// NewAmendment) by its meaning, so a retry that re-encodes it differently
// (spacing, key order) still matches.
func requestHash[T order.NewOrder | order.NewAmendment](n T) []byte {
	b, _ := json.Marshal(n) // plain strings and integers always encode
	sum := sha256.Sum256(b)
	return sum[:]
}

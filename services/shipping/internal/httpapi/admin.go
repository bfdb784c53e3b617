package httpapi

import (
	"context"
	"crypto/subtle"
	"errors"
	"net/http"
	"strconv"
	"strings"

	"github.com/go-chi/chi/v5"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// DeadLetters is what the operator endpoints need
// (services/shipping/internal/deadletter).
type DeadLetters interface {
	List(ctx context.Context) ([]shipment.Letter, []shipment.Hold, error)
	Replay(ctx context.Context, orderID string, version int64) (int, error)
	Discard(ctx context.Context, orderID string, version int64) (int, error)
}

// mountAdmin adds the operator's endpoints under /admin, behind the bearer
// token:
//
//	GET  /admin/dead-letters                                dead letters and held orders
//	POST /admin/dead-letters/{order_id}/{version}/replay    re-publish it, release its order
//	POST /admin/dead-letters/{order_id}/{version}/discard   skip its version, release its order
func (a *api) mountAdmin(r chi.Router) {
	r.Route("/admin/dead-letters", func(r chi.Router) {
		r.Use(a.requireAdmin)
		r.Get("/", a.listDeadLetters)
		r.Post("/{order_id}/{version}/replay", a.settle(a.cfg.DeadLetters.Replay, "replayed"))
		r.Post("/{order_id}/{version}/discard", a.settle(a.cfg.DeadLetters.Discard, "discarded"))
	})
}

func (a *api) requireAdmin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(token), []byte(a.cfg.AdminToken)) != 1 {
			w.Header().Set("WWW-Authenticate", "Bearer")
			writeError(w, http.StatusUnauthorized, "a valid bearer token is required")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (a *api) listDeadLetters(w http.ResponseWriter, r *http.Request) {
	letters, holds, err := a.cfg.DeadLetters.List(r.Context())
	if err != nil {
		a.log.ErrorContext(r.Context(), "list dead letters", "error", err)
		writeError(w, http.StatusServiceUnavailable, "dead letters are unavailable")
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"dead_letters": letters, "held_orders": holds})
}

func (a *api) settle(do func(context.Context, string, int64) (int, error), done string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		orderID := chi.URLParam(r, "order_id")
		version, err := strconv.ParseInt(chi.URLParam(r, "version"), 10, 64)
		if orderID == "" || len(orderID) > 200 || err != nil || version < 1 {
			writeError(w, http.StatusBadRequest, "want /admin/dead-letters/{order_id}/{version}/... with a positive version")
			return
		}
		released, err := do(r.Context(), orderID, version)
		switch {
		case errors.Is(err, shipment.ErrNoDeadLetter):
			writeError(w, http.StatusNotFound, "no dead letter at that order and version")
		case errors.Is(err, shipment.ErrBodyNotKept):
			writeError(w, http.StatusConflict, err.Error()+": replay it from the dead-letter queue, or discard it")
		case err != nil:
			a.log.ErrorContext(r.Context(), "settle dead letter", "aggregate_id", orderID, "version", version, "error", err)
			writeError(w, http.StatusServiceUnavailable, "could not finish; run it again to resume: "+err.Error())
		default:
			a.log.InfoContext(r.Context(), "dead letter "+done+" by operator", "aggregate_id", orderID, "version", version, "released", released)
			writeJSON(w, http.StatusOK, map[string]any{done: 1, "released": released})
		}
	}
}

package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"

	"github.com/outbox-inbox/reference/services/orders/internal/order"
)

// apiError is an error the API reports with a given status and machine-readable
// code. Handlers return these (or domain errors) and writeError maps them.
type apiError struct {
	status  int
	code    string
	message string
}

func (e *apiError) Error() string { return e.message }

func badRequest(code, message string) error {
	return &apiError{status: http.StatusBadRequest, code: code, message: message}
}

// errorBody is the JSON body of every error response.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Field   string `json:"field,omitempty"`
}

// writeError is the one place that maps an error to an HTTP status and body.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var (
		status int
		detail errorDetail
		ae     *apiError
		ve     *order.ValidationError
	)
	switch {
	case errors.As(err, &ae):
		status, detail = ae.status, errorDetail{Code: ae.code, Message: ae.message}
	case errors.As(err, &ve):
		status, detail = http.StatusUnprocessableEntity, errorDetail{Code: "invalid_field", Message: ve.Error(), Field: ve.Field}
	case errors.Is(err, order.ErrNotFound):
		status, detail = http.StatusNotFound, errorDetail{Code: "not_found", Message: err.Error()}
	case errors.Is(err, order.ErrCancelled):
		status, detail = http.StatusConflict, errorDetail{Code: "order_cancelled", Message: err.Error()}
	case errors.Is(err, order.ErrIdempotencyKeyReused):
		status, detail = http.StatusUnprocessableEntity, errorDetail{Code: "idempotency_key_reused", Message: err.Error()}
	case errors.Is(r.Context().Err(), context.Canceled):
		// The client went away; nobody reads the answer.
		status, detail = 499, errorDetail{Code: "client_closed_request", Message: "client closed the request"}
	default:
		s.logger.ErrorContext(r.Context(), "request failed", "method", r.Method, "path", r.URL.Path, "error", err)
		status, detail = http.StatusInternalServerError, errorDetail{Code: "internal", Message: "internal error"}
	}
	writeJSON(w, status, errorBody{Error: detail})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// A slog attribute helper keeps log keys consistent across handlers.
func orderAttrs(o order.Order) []any {
	return []any{slog.String("aggregate_id", o.ID), slog.String("status", o.Status), slog.Int64("version", o.Version)}
}

package httpapi

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/go-chi/chi/v5"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/services/orders/internal/order"
)

// OutboxAdmin is what the operator endpoints need from the outbox.
type OutboxAdmin interface {
	Status(ctx context.Context) (outboxadmin.Status, error)
	DeadLetters(ctx context.Context, afterID int64, limit int) ([]outboxadmin.DeadLetter, error)
	Retry(ctx context.Context, id int64) error
	RetryAll(ctx context.Context) (int64, error)
	Discard(ctx context.Context, id int64, reason string) error
}

var _ OutboxAdmin = (*outboxadmin.Admin)(nil)

// mountAdmin adds the operator's endpoints under /admin/outbox, behind the
// bearer token.
func (s *Server) mountAdmin(r chi.Router) {
	r.Route("/admin/outbox", func(r chi.Router) {
		r.Use(s.requireAdmin)
		r.Get("/status", s.handle(s.outboxStatus))
		r.Get("/dead-letters", s.handle(s.listDeadLetters))
		r.Post("/dead-letters/retry", s.handle(s.retryAllDeadLetters))
		r.Post("/dead-letters/{id}/retry", s.handle(s.retryDeadLetter))
		r.Post("/dead-letters/{id}/discard", s.handle(s.discardDeadLetter))
	})
}

func (s *Server) requireAdmin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(token), []byte(s.adminToken)) != 1 {
			w.Header().Set("WWW-Authenticate", "Bearer")
			s.writeError(w, r, &apiError{http.StatusUnauthorized, "unauthorized", "a valid bearer token is required"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// statusBody is Status with the age in seconds, for humans and scripts.
// pending_estimated says pending is an estimate (above outboxadmin.StatusCountLimit).
type statusBody struct {
	Pending                 int64   `json:"pending"`
	PendingEstimated        bool    `json:"pending_estimated"`
	DeadLettered            int64   `json:"dead_lettered"`
	OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
}

func (s *Server) outboxStatus(w http.ResponseWriter, r *http.Request) error {
	st, err := s.outbox.Status(r.Context())
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, statusBody{st.Pending, st.PendingEstimated, st.DeadLettered, st.OldestPendingAge.Seconds()})
	return nil
}

func (s *Server) listDeadLetters(w http.ResponseWriter, r *http.Request) error {
	limit, after := 100, int64(0)
	q := r.URL.Query()
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > outboxadmin.MaxDeadLettersPage {
			return badRequest("invalid_limit", fmt.Sprintf("limit must be an integer from 1 to %d", outboxadmin.MaxDeadLettersPage))
		}
		limit = n
	}
	if v := q.Get("after"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return badRequest("invalid_after", "after must be a non-negative id")
		}
		after = n
	}
	dls, err := s.outbox.DeadLetters(r.Context(), after, limit)
	if err != nil {
		return err
	}
	if dls == nil {
		dls = []outboxadmin.DeadLetter{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"dead_letters": dls})
	return nil
}

func deadLetterID(r *http.Request) (int64, error) {
	id, err := strconv.ParseInt(chi.URLParam(r, "id"), 10, 64)
	if err != nil || id < 1 {
		return 0, badRequest("invalid_id", "dead letter id must be a positive integer")
	}
	return id, nil
}

func (s *Server) retryDeadLetter(w http.ResponseWriter, r *http.Request) error {
	id, err := deadLetterID(r)
	if err != nil {
		return err
	}
	if err := s.outbox.Retry(r.Context(), id); err != nil {
		if errors.Is(err, outboxadmin.ErrNotFound) {
			return &apiError{http.StatusNotFound, "not_found", fmt.Sprintf("no dead letter with id %d", id)}
		}
		return err
	}
	s.wake()
	s.logger.InfoContext(r.Context(), "dead letter retried by operator", "event_id", id)
	writeJSON(w, http.StatusOK, map[string]any{"retried": 1})
	return nil
}

func (s *Server) retryAllDeadLetters(w http.ResponseWriter, r *http.Request) error {
	n, err := s.outbox.RetryAll(r.Context())
	if err != nil {
		return err
	}
	s.wake()
	s.logger.InfoContext(r.Context(), "all dead letters retried by operator", "count", n)
	writeJSON(w, http.StatusOK, map[string]any{"retried": n})
	return nil
}

// discardRequest is the body of a discard: why the event is given up on, kept
// with it in outbox_discarded.
type discardRequest struct {
	Reason string `json:"reason"`
}

// discardDeadLetter gives up on a dead letter that can never be published, so
// its aggregate's next events go out (outboxadmin.Admin.Discard).
func (s *Server) discardDeadLetter(w http.ResponseWriter, r *http.Request) error {
	id, err := deadLetterID(r)
	if err != nil {
		return err
	}
	var req discardRequest
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	switch {
	case strings.TrimSpace(req.Reason) == "":
		return &order.ValidationError{Field: "reason", Message: "is required: say why the event is discarded"}
	case len(req.Reason) > outboxadmin.MaxDiscardReasonBytes:
		return &order.ValidationError{Field: "reason", Message: fmt.Sprintf("must be at most %d bytes", outboxadmin.MaxDiscardReasonBytes)}
	case strings.ContainsRune(req.Reason, 0):
		return &order.ValidationError{Field: "reason", Message: "must not contain NUL"}
	}
	if err := s.outbox.Discard(r.Context(), id, req.Reason); err != nil {
		switch {
		case errors.Is(err, outboxadmin.ErrNotFound):
			return &apiError{http.StatusNotFound, "not_found", fmt.Sprintf("no event with id %d", id)}
		case errors.Is(err, outboxadmin.ErrNotDeadLettered):
			return &apiError{http.StatusConflict, "not_dead_lettered", fmt.Sprintf("event %d is not dead-lettered: only dead letters can be discarded", id)}
		}
		return err
	}
	s.wake()
	s.logger.InfoContext(r.Context(), "dead letter discarded by operator", "event_id", id, "reason", req.Reason)
	writeJSON(w, http.StatusOK, map[string]any{"discarded": id})
	return nil
}

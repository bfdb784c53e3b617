package httpapi_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/services/orders/internal/httpapi"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

const adminToken = "s3cret"

// setupAdmin is setup with the operator's endpoints on.
func setupAdmin(t *testing.T) bundle {
	t.Helper()
	pool := pgtest.NewPool(t)
	var wakes atomic.Int64
	api, err := httpapi.New(httpapi.Config{
		Orders:     postgres.NewStore(pool, postgres.StoreConfig{}),
		Outbox:     outboxadmin.New(pool),
		AdminToken: adminToken,
		Wake:       func() { wakes.Add(1) },
		Logger:     slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return bundle{pool: pool, srv: srv, wakes: &wakes}
}

// An operator discards a dead letter over HTTP; anything else is a 4xx with a
// JSON error, and changes nothing.
func TestAdminDiscardDeadLetter(t *testing.T) {
	t.Parallel()
	b := setupAdmin(t)
	ctx := context.Background()

	var got []outbox.Enqueued
	err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		m := func(id, event string) outbox.Message {
			return outbox.Message{AggregateType: "order", AggregateID: id, EventType: event, Payload: []byte(`{}`)}
		}
		var err error
		got, err = new(outbox.Writer).Enqueue(ctx, tx, m("o-1", "order.created"), m("o-1", "order.cancelled"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	dead, behind := got[0].ID, got[1].ID
	// What a relay does when an event reaches its MaxAttempts.
	if _, err := b.pool.Exec(ctx, `UPDATE outbox SET attempts = 10, last_error = 'nacked', dead_lettered_at = now() WHERE id = $1`, dead); err != nil {
		t.Fatal(err)
	}
	path := func(id int64) string { return "/admin/outbox/dead-letters/" + strconv.FormatInt(id, 10) + "/discard" }
	auth := []string{"Authorization", "Bearer " + adminToken}
	const body = `{"reason": "consumers reject it"}`

	for _, tc := range []struct {
		name, path, contentType, body string
		headers                       []string
		status                        int
		code                          string
	}{
		{"no token", path(dead), "application/json", body, nil, 401, "unauthorized"},
		{"wrong token", path(dead), "application/json", body, []string{"Authorization", "Bearer nope"}, 401, "unauthorized"},
		{"id not a number", "/admin/outbox/dead-letters/abc/discard", "application/json", body, auth, 400, "invalid_id"},
		{"id 0", path(0), "application/json", body, auth, 400, "invalid_id"},
		{"no body", path(dead), "application/json", "", auth, 400, "empty_body"},
		{"not JSON", path(dead), "application/json", "reason=x", auth, 400, "invalid_json"},
		{"wrong content type", path(dead), "text/plain", body, auth, 415, "unsupported_media_type"},
		{"unknown field", path(dead), "application/json", `{"reason": "x", "force": true}`, auth, 400, "invalid_json"},
		{"no reason", path(dead), "application/json", `{}`, auth, 422, "invalid_field"},
		{"blank reason", path(dead), "application/json", `{"reason": "  "}`, auth, 422, "invalid_field"},
		{"NUL in reason", path(dead), "application/json", `{"reason": "a\u0000b"}`, auth, 422, "invalid_field"},
		{"reason too long", path(dead), "application/json", `{"reason": "` + strings.Repeat("r", outboxadmin.MaxDiscardReasonBytes+1) + `"}`, auth, 422, "invalid_field"},
		{"not a dead letter", path(behind), "application/json", body, auth, 409, "not_dead_lettered"},
		{"no such event", path(behind + 100), "application/json", body, auth, 404, "not_found"},
	} {
		r := b.do(t, "POST", tc.path, tc.contentType, tc.body, tc.headers...)
		e, _ := r.body["error"].(map[string]any)
		if r.status != tc.status || e["code"] != tc.code {
			t.Errorf("%s: %d %s, want %d %s", tc.name, r.status, r.raw, tc.status, tc.code)
		}
	}
	if n := pgtest.Count(t, b.pool, "outbox_discarded"); n != 0 || b.wakes.Load() != 0 {
		t.Fatalf("rejected requests discarded %d events and woke the relay %d times", n, b.wakes.Load())
	}

	r := b.do(t, "POST", path(dead), "application/json", body, auth...)
	if r.status != http.StatusOK || r.body["discarded"] != float64(dead) {
		t.Fatalf("discard: %d %s", r.status, r.raw)
	}
	if b.wakes.Load() != 1 {
		t.Fatalf("relay woken %d times after a discard, want 1", b.wakes.Load())
	}
	var reason string
	var blocked bool
	err = b.pool.QueryRow(ctx, `SELECT (SELECT reason FROM outbox_discarded WHERE id = $1), (SELECT blocked FROM outbox WHERE id = $2)`,
		dead, behind).Scan(&reason, &blocked)
	if err != nil || reason != "consumers reject it" || blocked {
		t.Fatalf("after discard: reason %q, next event blocked %v, %v", reason, blocked, err)
	}
	if r := b.do(t, "POST", path(dead), "application/json", body, auth...); r.status != 404 {
		t.Fatalf("second discard: %d %s, want 404", r.status, r.raw)
	}
	st := b.do(t, "GET", "/admin/outbox/status", "", "", auth...)
	if st.status != 200 || st.body["pending"] != float64(1) || st.body["pending_estimated"] != false || st.body["dead_lettered"] != float64(0) {
		t.Fatalf("status after the discard: %d %s, want 1 pending (exact), no dead letter", st.status, st.raw)
	}
}

package httpapi_test

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/outbox-inbox/reference/services/orders/internal/order"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

// An amendment is the order's next version, 201 with the amendment; a retry
// with its key is answered with the same version (Idempotent-Replayed), even
// after the order was cancelled; a new amendment of a cancelled order is 409.
func TestAmendOrder(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.do(t, "POST", "/orders", "application/json", validBody).body["id"].(string)
	path := "/orders/" + id + "/amendments"

	for i := range 6 {
		r := b.do(t, "POST", path, "application/json", fmt.Sprintf(`{"note": "note %d"}`, i), "Idempotency-Key", fmt.Sprintf("a-%d", i))
		if r.status != http.StatusCreated || r.body["order_id"] != id || r.body["version"] != float64(i+2) ||
			r.body["note"] != fmt.Sprintf("note %d", i) || r.body["amended_at"] == "" || r.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("amendment %d: %d %s", i, r.status, r.raw)
		}
	}
	if g := b.do(t, "GET", "/orders/"+id, "", ""); g.body["version"] != float64(7) || g.body["note"] != "note 5" {
		t.Fatalf("order after 6 amendments: %s", g.raw)
	}
	retry := b.do(t, "POST", path, "application/json", "{\"note\":\n\"note 2\"}", "Idempotency-Key", "a-2")
	if retry.status != http.StatusCreated || retry.body["version"] != float64(4) || retry.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry of a-2: %d %s replayed=%q", retry.status, retry.raw, retry.header.Get("Idempotent-Replayed"))
	}
	reuse := b.do(t, "POST", path, "application/json", `{"note": "another"}`, "Idempotency-Key", "a-2")
	if reuse.status != http.StatusUnprocessableEntity || reuse.body["error"].(map[string]any)["code"] != "idempotency_key_reused" {
		t.Fatalf("a-2 with another note: %d %s", reuse.status, reuse.raw)
	}
	if c := b.do(t, "POST", "/orders/"+id+"/cancel", "", ""); c.status != 200 || c.body["version"] != float64(8) {
		t.Fatalf("cancel: %d %s", c.status, c.raw)
	}
	late := b.do(t, "POST", path, "application/json", `{"note": "too late"}`, "Idempotency-Key", "a-late")
	if late.status != http.StatusConflict || late.body["error"].(map[string]any)["code"] != "order_cancelled" {
		t.Fatalf("amendment of a cancelled order: %d %s", late.status, late.raw)
	}
	if again := b.do(t, "POST", path, "application/json", `{"note": "note 5"}`, "Idempotency-Key", "a-5"); again.status != 201 || again.body["version"] != float64(7) {
		t.Fatalf("retry of a-5 after the cancel: %d %s", again.status, again.raw)
	}
	var n int
	if err := b.pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE aggregate_id = $1 AND event_type = $2`, id, order.EventAmended).Scan(&n); err != nil || n != 6 {
		t.Fatalf("order.amended events = %d, %v; want 6", n, err)
	}
	if w := b.wakes.Load(); w != 1+6+1 {
		t.Fatalf("relay woken %d times, want once per write (create, 6 amendments, cancel)", w)
	}
}

// Concurrent retries of one amendment over HTTP make one version.
func TestConcurrentRetriesOfOneAmendmentOverHTTP(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.do(t, "POST", "/orders", "application/json", validBody).body["id"].(string)
	var wg sync.WaitGroup
	versions := make([]any, 6)
	for i := range versions {
		wg.Go(func() {
			r := b.do(t, "POST", "/orders/"+id+"/amendments", "application/json", `{"note": "n"}`, "Idempotency-Key", "same")
			if r.status != 201 {
				t.Errorf("amendment: %d %s", r.status, r.raw)
			}
			versions[i] = r.body["version"]
		})
	}
	wg.Wait()
	for _, v := range versions {
		if v != float64(2) {
			t.Fatalf("versions answered %v, want 2 for all", versions)
		}
	}
	if n := pgtest.Count(t, b.pool, "order_amendments"); n != 1 {
		t.Fatalf("order_amendments holds %d rows, want 1", n)
	}
}

func TestBadAmendmentIsRejectedAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.do(t, "POST", "/orders", "application/json", validBody).body["id"].(string)
	key := []string{"Idempotency-Key", "k-1"}
	cases := []struct {
		name, id, contentType, body string
		headers                     []string
		status                      int
		code                        string
	}{
		{"no idempotency key", id, "application/json", `{"note": "n"}`, nil, 422, "invalid_field"},
		{"two idempotency keys", id, "application/json", `{"note": "n"}`, []string{"Idempotency-Key", "a", "Idempotency-Key", "b"}, 422, "invalid_field"},
		{"bad idempotency key", id, "application/json", `{"note": "n"}`, []string{"Idempotency-Key", "has space"}, 422, "invalid_field"},
		{"missing note", id, "application/json", `{}`, key, 422, "invalid_field"},
		{"null note", id, "application/json", `{"note": null}`, key, 422, "invalid_field"},
		{"blank note", id, "application/json", `{"note": "  "}`, key, 422, "invalid_field"},
		{"note too long", id, "application/json", `{"note": "` + strings.Repeat("é", order.MaxNoteLength+1) + `"}`, key, 422, "invalid_field"},
		{"control character", id, "application/json", `{"note": "a\u001bb"}`, key, 422, "invalid_field"},
		{"note not a string", id, "application/json", `{"note": 5}`, key, 400, "invalid_json"},
		{"unknown field", id, "application/json", `{"note": "n", "items": []}`, key, 400, "invalid_json"},
		{"trailing data", id, "application/json", `{"note": "n"} x`, key, 400, "trailing_data"},
		{"empty body", id, "application/json", ``, key, 400, "empty_body"},
		{"wrong content type", id, "text/plain", `{"note": "n"}`, key, 415, "unsupported_media_type"},
		{"oversized body", id, "application/json", `{"note": "` + strings.Repeat("x", 70<<10) + `"}`, key, 413, "body_too_large"},
		{"id not a UUID", "42", "application/json", `{"note": "n"}`, key, 400, "invalid_id"},
		{"no such order", "6f1f2c55-7d53-4b8a-9a39-0d5c8e2f0c11", "application/json", `{"note": "n"}`, key, 404, "not_found"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := b.do(t, "POST", "/orders/"+tc.id+"/amendments", tc.contentType, tc.body, tc.headers...)
			errObj, _ := r.body["error"].(map[string]any)
			if r.status != tc.status || errObj == nil || errObj["code"] != tc.code || errObj["message"] == "" {
				t.Fatalf("got %d %s, want %d with code %q", r.status, r.raw, tc.status, tc.code)
			}
		})
	}
	if g := b.do(t, "GET", "/orders/"+id, "", ""); g.body["version"] != float64(1) {
		t.Fatalf("order after bad amendments: %s", g.raw)
	}
	if e, a := pgtest.Count(t, b.pool, "outbox"), pgtest.Count(t, b.pool, "order_amendments"); e != 1 || a != 0 {
		t.Fatalf("outbox=%d order_amendments=%d after bad amendments, want 1 and 0", e, a)
	}
	if b.wakes.Load() != 1 {
		t.Errorf("relay woken %d times, want once (the create)", b.wakes.Load())
	}
}

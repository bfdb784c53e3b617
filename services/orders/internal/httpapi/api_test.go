package httpapi_test

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/services/orders/internal/httpapi"
	"github.com/outbox-inbox/reference/services/orders/internal/order"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

const validBody = `{"customer_id": "c-42", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]}`

type bundle struct {
	pool  *pgxpool.Pool
	srv   *httptest.Server
	wakes *atomic.Int64
}

func setup(t *testing.T) bundle {
	t.Helper()
	pool := pgtest.NewPool(t)
	var wakes atomic.Int64
	api, err := httpapi.New(httpapi.Config{
		Orders: postgres.NewStore(pool, postgres.StoreConfig{}),
		Wake:   func() { wakes.Add(1) },
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	return bundle{pool: pool, srv: srv, wakes: &wakes}
}

type response struct {
	status int
	header http.Header
	body   map[string]any
	raw    string
}

func (b bundle) do(t *testing.T, method, path, contentType, body string, headers ...string) response {
	t.Helper()
	req, err := http.NewRequest(method, b.srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	r := response{status: resp.StatusCode, header: resp.Header, raw: string(raw)}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("%s %s: Content-Type %q, want application/json (body %s)", method, path, ct, raw)
	}
	if err := json.Unmarshal(raw, &r.body); err != nil {
		t.Fatalf("%s %s: body is not a JSON object: %v: %s", method, path, err, raw)
	}
	return r
}

func TestCreateGetCancel(t *testing.T) {
	t.Parallel()
	b := setup(t)

	r := b.do(t, "POST", "/orders", "application/json; charset=utf-8", validBody)
	if r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.raw)
	}
	id, _ := r.body["id"].(string)
	if id == "" || r.body["status"] != "created" || r.body["total"] != float64(2500) || r.header.Get("Location") != "/orders/"+id {
		t.Fatalf("create body %s location %q", r.raw, r.header.Get("Location"))
	}
	if b.wakes.Load() != 1 {
		t.Fatalf("relay woken %d times after a create, want 1", b.wakes.Load())
	}

	if g := b.do(t, "GET", "/orders/"+id, "", ""); g.status != 200 || g.body["id"] != id {
		t.Fatalf("get: %d %s", g.status, g.raw)
	}

	c := b.do(t, "POST", "/orders/"+id+"/cancel", "", "")
	if c.status != 200 || c.body["status"] != "cancelled" || c.body["version"] != float64(2) {
		t.Fatalf("cancel: %d %s", c.status, c.raw)
	}
	c2 := b.do(t, "POST", "/orders/"+id+"/cancel", "", "")
	if c2.status != 200 || c2.body["status"] != "cancelled" || c2.body["version"] != float64(2) {
		t.Fatalf("second cancel: %d %s", c2.status, c2.raw)
	}
	if n := pgtest.Count(t, b.pool, "outbox"); n != 2 {
		t.Fatalf("outbox has %d rows after create + 2 cancels, want 2", n)
	}
	if b.wakes.Load() != 2 {
		t.Fatalf("relay woken %d times, want 2 (the no-op cancel wakes nobody)", b.wakes.Load())
	}

	for _, tc := range []struct {
		method, path string
		status       int
	}{
		{"GET", "/orders/6f1f2c55-7d53-4b8a-9a39-0d5c8e2f0c11", 404},
		{"POST", "/orders/6f1f2c55-7d53-4b8a-9a39-0d5c8e2f0c11/cancel", 404},
		{"GET", "/orders/not-a-uuid", 400},
		{"POST", "/orders/not-a-uuid/cancel", 400},
		{"GET", "/nowhere", 404},
		{"DELETE", "/orders/" + id, 405},
	} {
		if r := b.do(t, tc.method, tc.path, "", ""); r.status != tc.status || r.body["error"] == nil {
			t.Errorf("%s %s: %d %s, want %d with an error body", tc.method, tc.path, r.status, r.raw, tc.status)
		}
	}
}

func TestIdempotencyKey(t *testing.T) {
	t.Parallel()
	b := setup(t)

	first := b.do(t, "POST", "/orders", "application/json", validBody, "Idempotency-Key", "key-1")
	// Same request, other spacing and key order: a retry.
	retryBody := `{"items":[{"unit_price":1250,"quantity":2,"sku":"sku-1"}],"currency":"EUR","customer_id":"c-42"}`
	retry := b.do(t, "POST", "/orders", "application/json", retryBody, "Idempotency-Key", "key-1")
	if first.status != 201 || retry.status != 201 || retry.body["id"] != first.body["id"] {
		t.Fatalf("first %d %s, retry %d %s", first.status, first.raw, retry.status, retry.raw)
	}
	if retry.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("retry lacks Idempotent-Replayed: true")
	}
	other := strings.Replace(validBody, `"quantity": 2`, `"quantity": 3`, 1)
	reuse := b.do(t, "POST", "/orders", "application/json", other, "Idempotency-Key", "key-1")
	if reuse.status != 422 || reuse.body["error"].(map[string]any)["code"] != "idempotency_key_reused" {
		t.Fatalf("reuse: %d %s", reuse.status, reuse.raw)
	}
	if o, e := pgtest.Count(t, b.pool, "orders"), pgtest.Count(t, b.pool, "outbox"); o != 1 || e != 1 {
		t.Fatalf("orders=%d outbox=%d, want 1 and 1", o, e)
	}
	if b.wakes.Load() != 1 {
		t.Fatalf("woken %d times, want 1", b.wakes.Load())
	}
}

func TestBadInputIsRejectedAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	item := `{"sku": "sku-1", "quantity": 2, "unit_price": 1250}`
	withItem := func(it string) string {
		return `{"customer_id": "c-42", "currency": "EUR", "items": [` + it + `]}`
	}
	cases := []struct {
		name, contentType, body string
		headers                 []string
		status                  int
		code                    string
	}{
		{"malformed JSON", "application/json", `{"customer_id": "c-42",`, nil, 400, "invalid_json"},
		{"not an object", "application/json", `[1,2]`, nil, 400, "invalid_json"},
		{"data after the object", "application/json", validBody + `{"x":1}`, nil, 400, "trailing_data"},
		{"garbage after the object", "application/json", validBody + ` x`, nil, 400, "trailing_data"},
		{"unknown field", "application/json", `{"customer_id": "c-42", "currency": "EUR", "items": [` + item + `], "discount": 5}`, nil, 400, "invalid_json"},
		{"unknown item field", "application/json", withItem(`{"sku": "s", "quantity": 1, "unit_price": 1, "color": "red"}`), nil, 400, "invalid_json"},
		{"NUL byte in a string", "application/json", `{"customer_id": "c\u0000", "currency": "EUR", "items": [` + item + `]}`, nil, 422, "invalid_field"},
		{"raw NUL byte", "application/json", "{\"customer_id\": \"c\x00\", \"currency\": \"EUR\", \"items\": [" + item + "]}", nil, 400, "invalid_json"},
		{"empty body", "application/json", ``, nil, 400, "empty_body"},
		{"whitespace body", "application/json", "  \n", nil, 400, "empty_body"},
		{"oversized body", "application/json", `{"customer_id": "` + strings.Repeat("x", httpapi.MaxBodyBytes) + `"}`, nil, 413, "body_too_large"},
		{"no content type", "", validBody, nil, 415, "unsupported_media_type"},
		{"wrong content type", "text/plain", validBody, nil, 415, "unsupported_media_type"},
		{"negative quantity", "application/json", withItem(`{"sku": "s", "quantity": -1, "unit_price": 1}`), nil, 422, "invalid_field"},
		{"zero quantity", "application/json", withItem(`{"sku": "s", "quantity": 0, "unit_price": 1}`), nil, 422, "invalid_field"},
		{"overflowing quantity", "application/json", withItem(`{"sku": "s", "quantity": 99999999999999999999, "unit_price": 1}`), nil, 422, "invalid_field"},
		{"fractional quantity", "application/json", withItem(`{"sku": "s", "quantity": 1.5, "unit_price": 1}`), nil, 422, "invalid_field"},
		{"negative amount", "application/json", withItem(`{"sku": "s", "quantity": 1, "unit_price": -100}`), nil, 422, "invalid_field"},
		{"zero amount", "application/json", withItem(`{"sku": "s", "quantity": 1, "unit_price": 0}`), nil, 422, "invalid_field"},
		{"overflowing amount", "application/json", withItem(`{"sku": "s", "quantity": 1, "unit_price": 9223372036854775808}`), nil, 422, "invalid_field"},
		{"total overflow", "application/json", withItem(strings.Repeat(`{"sku": "s", "quantity": 1000000, "unit_price": 1000000000000},`, 19) + `{"sku": "s", "quantity": 1000000, "unit_price": 1000000000000}`), nil, 422, "invalid_field"},
		{"amount as string", "application/json", withItem(`{"sku": "s", "quantity": 1, "unit_price": "100"}`), nil, 422, "invalid_field"},
		{"missing customer", "application/json", `{"currency": "EUR", "items": [` + item + `]}`, nil, 422, "invalid_field"},
		{"missing items", "application/json", `{"customer_id": "c-42", "currency": "EUR"}`, nil, 422, "invalid_field"},
		{"missing quantity", "application/json", withItem(`{"sku": "s", "unit_price": 1}`), nil, 422, "invalid_field"},
		{"null currency", "application/json", `{"customer_id": "c-42", "currency": null, "items": [` + item + `]}`, nil, 422, "invalid_field"},
		{"bad currency", "application/json", `{"customer_id": "c-42", "currency": "euro", "items": [` + item + `]}`, nil, 422, "invalid_field"},
		{"bad idempotency key", "application/json", validBody, []string{"Idempotency-Key", "has space"}, 422, "invalid_field"},
		{"two idempotency keys", "application/json", validBody, []string{"Idempotency-Key", "a", "Idempotency-Key", "b"}, 400, "invalid_header"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := b.do(t, "POST", "/orders", tc.contentType, tc.body, tc.headers...)
			errObj, _ := r.body["error"].(map[string]any)
			if r.status != tc.status || errObj == nil || errObj["code"] != tc.code || errObj["message"] == "" {
				t.Fatalf("got %d %s, want %d with code %q", r.status, r.raw, tc.status, tc.code)
			}
		})
	}
	for _, table := range []string{"orders", "outbox", "idempotency_keys"} {
		if n := pgtest.Count(t, b.pool, table); n != 0 {
			t.Errorf("%s has %d rows after bad requests, want 0", table, n)
		}
	}
	if b.wakes.Load() != 0 {
		t.Errorf("relay woken %d times by rejected requests", b.wakes.Load())
	}
}

func TestConcurrentCancelsOverHTTP(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.do(t, "POST", "/orders", "application/json", validBody).body["id"].(string)
	var wg sync.WaitGroup
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r := b.do(t, "POST", "/orders/"+id+"/cancel", "", ""); r.status != 200 {
				t.Errorf("cancel: %d %s", r.status, r.raw)
			}
		}()
	}
	wg.Wait()
	var n int
	var version int64
	err := b.pool.QueryRow(t.Context(), `SELECT count(*), max(aggregate_version) FROM outbox WHERE event_type = $1`, order.EventCancelled).Scan(&n, &version)
	if err != nil || n != 1 || version != 2 {
		t.Fatalf("cancelled events = %d (max version %d), want exactly 1 with version 2: %v", n, version, err)
	}
}

func TestHealthAndReadiness(t *testing.T) {
	t.Parallel()
	b := setup(t)
	if r := b.do(t, "GET", "/healthz", "", ""); r.status != 200 {
		t.Fatalf("healthz %d", r.status)
	}
	if r := b.do(t, "GET", "/readyz", "", ""); r.status != 200 {
		t.Fatalf("readyz %d %s", r.status, r.raw)
	}
	b.pool.Close()
	if r := b.do(t, "GET", "/readyz", "", ""); r.status != 503 {
		t.Fatalf("readyz with the database gone: %d, want 503", r.status)
	}
}

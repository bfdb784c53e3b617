package httpapi_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

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

func setup(t *testing.T) bundle { return setupTraced(t, nil) }

// setupTraced is setup with the API and the store tracing to tp (nil: off),
// storing the baggage members tenant and session.
func setupTraced(t *testing.T, tp trace.TracerProvider) bundle {
	return setupTrusting(t, tp, nil)
}

// setupTrusting is setupTraced with the API trusting the callers trust
// says (nil: all).
func setupTrusting(t *testing.T, tp trace.TracerProvider, trust func(*http.Request) bool) bundle {
	t.Helper()
	pool := pgtest.NewPool(t)
	var wakes atomic.Int64
	api, err := httpapi.New(httpapi.Config{
		Orders: postgres.NewStore(pool, postgres.StoreConfig{TracerProvider: tp, EventDestination: "orders.events",
			BaggageKeys: []string{"tenant", "session"}}),
		Wake:              func() { wakes.Add(1) },
		Logger:            slog.New(slog.DiscardHandler),
		TracerProvider:    tp,
		TrustTraceContext: trust,
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
		{"idempotency key with invalid UTF-8", "application/json", validBody, []string{"Idempotency-Key", "k\xff\xfe"}, 422, "invalid_field"},
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

// No trace context header a client sends can make a request fail: an invalid
// traceparent is ignored (with tracing on, the request starts a new trace;
// off, no trace context is stored), an invalid tracestate is dropped, and the
// order and its events are written either way.
func TestTraceContextHeadersNeverFailARequest(t *testing.T) {
	t.Parallel()
	for _, traced := range []bool{false, true} {
		t.Run(map[bool]string{false: "tracing off", true: "tracing on"}[traced], func(t *testing.T) {
			t.Parallel()
			var tp trace.TracerProvider
			if traced {
				tp = sdktrace.NewTracerProvider(sdktrace.WithSyncer(tracetest.NewInMemoryExporter()))
			}
			traceContextCases(t, setupTraced(t, tp), traced)
		})
	}
}

func traceContextCases(t *testing.T, b bundle, traced bool) {
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	cases := []struct {
		name           string
		headers        []string
		valid          bool   // the client's traceparent is valid
		wantTracestate string // "" when no tracestate must be stored
	}{
		{"valid", []string{"Traceparent", tp, "Tracestate", "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7"}, true, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"},
		{"tracestate with invalid UTF-8", []string{"Traceparent", tp, "Tracestate", "congo=\xff\xfe"}, true, ""},
		{"tracestate key with invalid UTF-8", []string{"Traceparent", tp, "Tracestate", "\xc3\x28=1"}, true, ""},
		{"tracestate of 33 members", []string{"Traceparent", tp, "Tracestate", manyMembers(33)}, true, ""},
		{"tracestate with a duplicate key", []string{"Traceparent", tp, "Tracestate", "a=1,a=2"}, true, ""},
		{"tracestate in two header fields", []string{"Traceparent", tp, "Tracestate", "a=1", "Tracestate", "b=2"}, true, "a=1,b=2"},
		{"baggage that is not baggage", []string{"Traceparent", tp, "Baggage", "\xff=;;;=,=="}, true, ""},
		{"traceparent with invalid UTF-8", []string{"Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e47\xff\xfe-00f067aa0ba902b7-01", "Tracestate", "a=1"}, false, ""},
		{"traceparent in upper case", []string{"Traceparent", strings.ToUpper(tp), "Tracestate", "a=1"}, false, ""},
		{"traceparent version ff", []string{"Traceparent", "ff" + tp[2:], "Tracestate", "a=1"}, false, ""},
		{"two traceparents", []string{"Traceparent", tp, "Traceparent", tp}, false, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := b.do(t, "POST", "/orders", "application/json", validBody, tc.headers...)
			if c.status != http.StatusCreated {
				t.Fatalf("create: %d %s", c.status, c.raw)
			}
			id := c.body["id"].(string)
			if r := b.do(t, "POST", "/orders/"+id+"/cancel", "", "", tc.headers...); r.status != http.StatusOK {
				t.Fatalf("cancel: %d %s", r.status, r.raw)
			}
			stored := storedHeaders(t, b, id)
			if len(stored) != 2 {
				t.Fatalf("events of the order: %v, want created and cancelled", stored)
			}
			for _, h := range stored {
				parent, ok := h["traceparent"]
				switch {
				case !traced && tc.valid && parent != tp:
					t.Errorf("traceparent %q, want the client's %q", parent, tp)
				case !traced && !tc.valid && ok:
					t.Errorf("traceparent %q stored with tracing off and no valid client context", parent)
				case traced && (!validTraceparent(parent) || parent == tp):
					t.Errorf("traceparent %q, want one of the write span", parent)
				case traced && tc.valid && parent[3:35] != tp[3:35]:
					t.Errorf("traceparent %q, want the client's trace", parent)
				case traced && !tc.valid && strings.Contains(strings.ToLower(tp), parent[3:35]):
					t.Errorf("traceparent %q, want a new trace", parent)
				}
				if ts, ok := h["tracestate"]; ts != tc.wantTracestate || (tc.wantTracestate == "" && ok) {
					t.Errorf("tracestate %q (present %v), want %q", ts, ok, tc.wantTracestate)
				}
			}
		})
	}
}

// storedHeaders returns the headers of an order's events, in version order.
func storedHeaders(t *testing.T, b bundle, id string) []map[string]string {
	t.Helper()
	rows, err := b.pool.Query(t.Context(), `SELECT headers FROM outbox WHERE aggregate_id = $1 ORDER BY aggregate_version`, id)
	if err != nil {
		t.Fatal(err)
	}
	var stored []map[string]string
	for rows.Next() {
		var h map[string]string
		if err := rows.Scan(&h); err != nil {
			t.Fatal(err)
		}
		stored = append(stored, h)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return stored
}

func manyMembers(n int) string {
	m := make([]string, n)
	for i := range m {
		m[i] = fmt.Sprintf("k%d=v", i)
	}
	return strings.Join(m, ",")
}

var traceparentPattern = regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$`)

func validTraceparent(s string) bool { return traceparentPattern.MatchString(s) }

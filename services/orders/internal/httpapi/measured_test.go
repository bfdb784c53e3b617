package httpapi_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-inbox/reference/services/orders/internal/httpapi"
	"github.com/outbox-inbox/reference/services/orders/internal/metrics"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

// Every request is counted by its route's pattern, whatever the ids in its
// path, with its method and status; requests no route matched share one
// label, and so do methods that are not standard; a failed write (the
// database gone) is a 5xx of its route.
func TestRequestsAreMeasuredByRoutePattern(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	reg := prometheus.NewRegistry()
	api, err := httpapi.New(httpapi.Config{
		Orders:   postgres.NewStore(pool, postgres.StoreConfig{EventDestination: "orders.events"}),
		Logger:   slog.New(slog.DiscardHandler),
		Requests: metrics.NewRequests(reg),
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close)
	b := bundle{pool: pool, srv: srv}

	created := b.do(t, "POST", "/orders", "application/json", validBody)
	if created.status != http.StatusCreated {
		t.Fatalf("POST /orders: %d %s", created.status, created.raw)
	}
	id, _ := created.body["id"].(string)
	b.do(t, "GET", "/orders/"+id, "", "")
	b.do(t, "GET", "/orders/no-such-order", "", "")
	b.do(t, "POST", "/orders/"+id+"/cancel", "", "")
	b.do(t, "POST", "/orders", "application/json", `{"customer_id": ""}`)
	b.do(t, "GET", "/no/such/path/"+id, "", "")
	b.do(t, "BREW", "/orders", "", "")
	pool.Close()
	b.do(t, "POST", "/orders", "application/json", validBody)

	want := map[string]uint64{
		"POST /orders 201":             1,
		"POST /orders 422":             1,
		"POST /orders 500":             1,
		"GET /orders/{id} 200":         1,
		"GET /orders/{id} 400":         1, // not an order id
		"POST /orders/{id}/cancel 200": 1,
		"GET unmatched 404":            1,
		"_OTHER unmatched 405":         1,
	}
	got := map[string]uint64{}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != "http_server_request_duration_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			got[strings.Join([]string{l["method"], l["route"], l["code"]}, " ")] += m.GetHistogram().GetSampleCount()
		}
	}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("%s: %d requests, want %d (all: %v)", k, got[k], n, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("series %v, want exactly %v", got, want)
	}
}

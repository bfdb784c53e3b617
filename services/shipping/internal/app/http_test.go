package app_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/services/shipping/internal/app"
)

func get(t *testing.T, url string) (int, string, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Content-Type"), string(b)
}

func TestHTTPEndpoints(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{})
	base := "http://" + a.HTTPAddr()

	e.pub.publish(created("801", "order-8"))
	e.pub.publish(cancelled("802", "order-8"))
	e.waitShipment("order-8", 2)

	status, ctype, body := get(t, base+"/shipments/order-8")
	if status != http.StatusOK || ctype != "application/json" {
		t.Fatalf("GET shipment: %d %s %s", status, ctype, body)
	}
	var s struct {
		OrderID string `json:"order_id"`
		Status  string `json:"status"`
		Events  []struct {
			MessageID string `json:"message_id"`
			EventType string `json:"event_type"`
			Version   int64  `json:"version"`
		} `json:"events"`
	}
	if err := json.Unmarshal([]byte(body), &s); err != nil {
		t.Fatalf("decode %s: %v", body, err)
	}
	if s.OrderID != "order-8" || s.Status != "cancelled" || len(s.Events) != 2 ||
		s.Events[0].MessageID != "801" || s.Events[0].EventType != "order.created" || s.Events[0].Version != 1 ||
		s.Events[1].MessageID != "802" || s.Events[1].EventType != "order.cancelled" || s.Events[1].Version != 2 {
		t.Fatalf("shipment %s", body)
	}

	for _, tc := range []struct {
		path, wantBody string
		status         int
	}{
		{"/shipments/nope", `"error":"shipment not found"`, http.StatusNotFound},
		{"/healthz", `"status":"ok"`, http.StatusOK},
		{"/readyz", `"status":"ready"`, http.StatusOK},
		{"/nowhere", `"error":"not found"`, http.StatusNotFound},
	} {
		status, ctype, body := get(t, base+tc.path)
		if status != tc.status || ctype != "application/json" || !strings.Contains(body, tc.wantBody) {
			t.Errorf("GET %s: %d %s %s; want %d with %s", tc.path, status, ctype, body, tc.status, tc.wantBody)
		}
	}

	// The shipment is visible before its delivery's counters move (the
	// effect, then the inbox record, then the ack and the metrics): poll.
	want := []string{
		"shipping_events_processed_total 2",
		`shipping_events_duplicate_total{layer="inbox"}`,
		"shipping_events_dead_lettered_total",
		`shipping_events_deferred_total{reason="gap"}`,
		"shipping_handler_duration_seconds_bucket",
		"shipping_consumer_up 1",
		"shipping_broker_connections_total 1",
		"amqp_nodes_configured 1",
	}
	var missing []string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		status, _, body = get(t, base+"/metrics")
		if status != http.StatusOK {
			t.Fatalf("GET /metrics: %d", status)
		}
		missing = missing[:0]
		for _, name := range want {
			if !strings.Contains(body, name) {
				missing = append(missing, name)
			}
		}
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
	}
	for _, name := range missing {
		t.Errorf("/metrics lacks %q", name)
	}
}

func TestReadyzReportsEachUnavailableDependency(t *testing.T) {
	t.Parallel()
	a, err := app.New(app.Config{
		AMQPURL:  "amqp://guest:guest@127.0.0.1:1/",
		MongoURI: "mongodb://127.0.0.1:1/shipping",
		HTTPAddr: "127.0.0.1:0",
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	var status int
	var body string
	deadline := time.Now().Add(30 * time.Second)
	for {
		status, _, body = get(t, "http://"+a.HTTPAddr()+"/readyz")
		if status != 0 || time.Now().After(deadline) {
			break
		}
	}
	var r struct {
		Status string            `json:"status"`
		Checks map[string]string `json:"checks"`
	}
	if err := json.Unmarshal([]byte(body), &r); err != nil {
		t.Fatalf("decode %s: %v", body, err)
	}
	if status != http.StatusServiceUnavailable || r.Status != "not ready" || r.Checks["mongodb"] == "ok" || r.Checks["broker"] == "ok" {
		t.Fatalf("readyz with nothing reachable: %d %s", status, body)
	}
	if s, _, _ := get(t, "http://"+a.HTTPAddr()+"/healthz"); s != http.StatusOK {
		t.Fatalf("healthz %d, want 200 while dependencies are down", s)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]app.Config{
		"no broker":     {MongoURI: "mongodb://127.0.0.1:1"},
		"no mongo":      {AMQPURL: "amqp://127.0.0.1:1/"},
		"bad mongo uri": {AMQPURL: "amqp://127.0.0.1:1/", MongoURI: "postgres://x"},
		"bad amqp url":  {AMQPURL: "http://x", MongoURI: "mongodb://127.0.0.1:1"},
		"bad http addr": {AMQPURL: "amqp://127.0.0.1:1/", MongoURI: "mongodb://127.0.0.1:1", HTTPAddr: "nowhere"},
		"bad prefetch":  {AMQPURL: "amqp://127.0.0.1:1/", MongoURI: "mongodb://127.0.0.1:1", Prefetch: -1},
		"bad attempts":  {AMQPURL: "amqp://127.0.0.1:1/", MongoURI: "mongodb://127.0.0.1:1", MaxAttempts: -1},
	} {
		t.Run(name, func(t *testing.T) {
			cfg.HTTPAddr = cmpOr(cfg.HTTPAddr, "127.0.0.1:0")
			if _, err := app.New(cfg); err == nil {
				t.Fatalf("New(%+v) succeeded, want an error", cfg)
			}
		})
	}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

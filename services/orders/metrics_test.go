package main

import (
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// /metrics counts the orders created and cancelled: an idempotent replay of a
// creation and the cancel of a cancelled order change nothing and count
// nothing.
func TestMetricsCountOrdersCreatedAndCancelled(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	start(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": newVhost(t), "HTTP_ADDR": addr,
	})
	base := "http://" + addr
	waitReady(t, base)
	waitMetrics(t, base, "\norders_created_total 0\n", "\norders_cancelled_total 0\n")

	for _, want := range []int{http.StatusCreated, http.StatusCreated} { // the second is a replay
		if status, o := post(t, base+"/orders", orderBody, "Idempotency-Key", "metrics-test-1"); status != want {
			t.Fatalf("create: %d %v", status, o)
		}
	}
	status, o := post(t, base+"/orders", orderBody)
	if status != http.StatusCreated {
		t.Fatalf("create: %d %v", status, o)
	}
	id, _ := o["id"].(string)
	for range 2 {
		if status, o := post(t, base+"/orders/"+id+"/cancel", ""); status != http.StatusOK {
			t.Fatalf("cancel: %d %v", status, o)
		}
	}
	waitMetrics(t, base, "\norders_created_total 2\n", "\norders_cancelled_total 1\n")
	// Every request, replays included, by route pattern (the API's
	// request metrics, which the availability alerts read).
	waitMetrics(t, base,
		"\nhttp_server_request_duration_seconds_count{code=\"201\",method=\"POST\",route=\"/orders\"} 3\n",
		"\nhttp_server_request_duration_seconds_count{code=\"200\",method=\"POST\",route=\"/orders/{id}/cancel\"} 2\n")
}

// outbox_publisher_ready is what the standalone relay's /readyz says of the
// broker, for Prometheus: 1 while connected, 0 once the broker closed the
// connection and refuses it (the relay's vhost deleted). The relay's
// AMQP_URL lists the node twice, as a cluster's nodes are listed:
// amqp_nodes_configured counts them.
func TestMetricsPublisherReadyFollowsTheBroker(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	start(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": amqpURL + "," + amqpURL, "HTTP_ADDR": addr,
		"RELAY_POLL_INTERVAL": "50ms",
	}, "relay")
	base := "http://" + addr
	waitReadyz(t, base, http.StatusOK)
	waitMetrics(t, base, "\noutbox_publisher_ready 1\n", "\namqp_nodes_configured 2\n")

	rabbitmqctl(t, "delete_vhost", strings.TrimPrefix(u.Path, "/"))
	waitReadyz(t, base, http.StatusServiceUnavailable)
	waitMetrics(t, base, "\noutbox_publisher_ready 0\n")
}

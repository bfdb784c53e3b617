package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// rabbitmqctl runs one rabbitmqctl command, failing the test on an error.
func rabbitmqctl(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput(); err != nil {
		t.Fatalf("rabbitmqctl %v: %v: %s", args, err, out)
	}
}

// waitReadyz polls /readyz until it answers want, and returns its JSON body.
func waitReadyz(t *testing.T, base string, want int) map[string]any {
	t.Helper()
	deadline := time.Now().Add(40 * time.Second)
	var last string
	for {
		resp, err := http.Get(base + "/readyz")
		if err == nil {
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			last = resp.Status + " " + string(raw)
			if resp.StatusCode == want {
				var body map[string]any
				if err := json.Unmarshal(raw, &body); err != nil {
					t.Fatalf("/readyz %s: body is not JSON: %v", last, err)
				}
				return body
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz never answered %d; last: %s", want, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The standalone relay's /readyz reports the broker: 503 with a body naming it
// while the relay has no connection to RabbitMQ (its vhost deleted: the
// connection is closed and every reconnect refused), 200 again once the relay
// has reconnected.
func TestStandaloneRelayReadyzReportsTheBroker(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	vhost := strings.TrimPrefix(u.Path, "/")
	addr := freeAddr(t)
	start(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": amqpURL, "HTTP_ADDR": addr,
		"RELAY_POLL_INTERVAL": "50ms",
	}, "relay")
	base := "http://" + addr
	if body := waitReadyz(t, base, http.StatusOK); body["status"] != "ready" {
		t.Fatalf("/readyz 200 with body %v", body)
	}

	rabbitmqctl(t, "delete_vhost", vhost)
	body := waitReadyz(t, base, http.StatusServiceUnavailable)
	if msg, _ := body["broker"].(string); body["status"] != "unavailable" || msg == "" {
		t.Fatalf("/readyz 503 body %v, want status unavailable and the broker's error", body)
	}
	if _, ok := body["database"]; ok {
		t.Fatalf("/readyz 503 body %v blames the database, which is up", body)
	}

	rabbitmqctl(t, "add_vhost", vhost)
	rabbitmqctl(t, "set_permissions", "-p", vhost, u.User.Username(), ".*", ".*", ".*")
	if body := waitReadyz(t, base, http.StatusOK); body["status"] != "ready" {
		t.Fatalf("/readyz 200 with body %v after the broker came back", body)
	}
}

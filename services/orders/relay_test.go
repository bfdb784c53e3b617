package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

func testAMQPURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

// newVhost creates a RabbitMQ vhost for one test, deleted when it ends, and
// returns the AMQP URL that points at it.
func newVhost(t *testing.T) string {
	t.Helper()
	base, err := url.Parse(testAMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	if conn, err := amqp.Dial(base.String()); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ unreachable (required under CI=true): %v", err)
		}
		t.Skipf("RabbitMQ unreachable: %v", err)
	} else {
		conn.Close()
	}
	name := "orders-test-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	user := base.User.Username()
	for _, args := range [][]string{
		{"add_vhost", name},
		{"set_permissions", "-p", name, user, ".*", ".*", ".*"},
	} {
		if out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("rabbitmqctl %v: %v: %s", args, err, out)
		}
	}
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "-q", "delete_vhost", name).Run() })
	base.Path = "/" + name
	return base.String()
}

// bindQueue declares the orders exchange and a queue bound to every order
// event, and returns its deliveries.
func bindQueue(t *testing.T, amqpURL string) <-chan amqp.Delivery {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare("orders.events", "topic", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclare("test-orders", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(q.Name, "order.*", "orders.events", false, nil); err != nil {
		t.Fatal(err)
	}
	d, err := ch.Consume(q.Name, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func receive(t *testing.T, d <-chan amqp.Delivery) amqp.Delivery {
	t.Helper()
	select {
	case m := <-d:
		return m
	case <-time.After(20 * time.Second):
		t.Fatal("no message within 20s")
		return amqp.Delivery{}
	}
}

// process runs the orders command with env until the test ends.
type process struct {
	logs syncBuffer
	done chan error
}

func start(t *testing.T, env map[string]string, args ...string) *process {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &process{done: make(chan error, 1)}
	go func() { p.done <- run(ctx, args, func(k string) string { return env[k] }, &p.logs, &p.logs) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-p.done:
			if err != nil {
				t.Errorf("orders %v: %v", args, err)
			}
		case <-time.After(20 * time.Second):
			t.Errorf("orders %v did not stop", args)
		}
		if t.Failed() {
			t.Logf("orders %v logs:\n%s", args, p.logs.String())
		}
	})
	return p
}

func waitReady(t *testing.T, base string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(base + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s not ready", base)
}

func post(t *testing.T, url, body string, headers ...string) (int, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	return doJSON(t, req)
}

func doJSON(t *testing.T, req *http.Request) (int, map[string]any) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("%s %s: %d %s", req.Method, req.URL, resp.StatusCode, raw)
	}
	return resp.StatusCode, m
}

const orderBody = `{"customer_id": "c-42", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]}`

// The default process runs the API and the relay: an order and its cancel reach
// RabbitMQ as two persistent messages with the contract of docs/events.md.
func TestServePublishesOrderEvents(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	deliveries := bindQueue(t, amqpURL)
	addr := freeAddr(t)
	start(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": amqpURL, "HTTP_ADDR": addr,
		// Far longer than any wait below: only the API's in-process wake-up
		// can publish in time (the API sends no NOTIFY when it runs the relay).
		"RELAY_POLL_INTERVAL": "1h",
	})
	base := "http://" + addr
	waitReady(t, base)

	// A first order, published by whatever comes first (the relay's first
	// claim at start may find it): once its batch is counted, the relay has
	// gone back to waiting, and only a wake-up brings it to the next order.
	status, o := post(t, base+"/orders", orderBody)
	if status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	if m := receive(t, deliveries); m.Headers["aggregate_id"] != o["id"] {
		t.Fatalf("first message %s %v, want the first order's event", m.MessageId, m.Headers)
	}
	waitMetrics(t, base, "\noutbox_published_total 1\n")

	status, o = post(t, base+"/orders", orderBody)
	if status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	id := o["id"].(string)
	if status, _ := post(t, base+"/orders/"+id+"/cancel", ""); status != 200 {
		t.Fatalf("cancel: %d", status)
	}

	var prevID int64
	for i, want := range []string{"order.created", "order.cancelled"} {
		m := receive(t, deliveries)
		msgID, _, err := outbox.ParseMessageID(m.MessageId)
		if err != nil || msgID <= prevID {
			t.Fatalf("message %d: MessageId %q, want an outbox id above %d", i, m.MessageId, prevID)
		}
		prevID = msgID
		if m.RoutingKey != want || m.Type != want || m.Headers["event_type"] != want {
			t.Errorf("message %d: routing key %q type %q header %v, want %s", i, m.RoutingKey, m.Type, m.Headers["event_type"], want)
		}
		if m.DeliveryMode != amqp.Persistent || m.ContentType != "application/json" {
			t.Errorf("message %d: delivery mode %d content type %q", i, m.DeliveryMode, m.ContentType)
		}
		if m.Headers["aggregate_type"] != "order" || m.Headers["aggregate_id"] != id || fmt.Sprint(m.Headers["aggregate_version"]) != strconv.Itoa(i+1) {
			t.Errorf("message %d: headers %v", i, m.Headers)
		}
		// Tracing off and no client context: no trace is invented.
		if tp, ok := m.Headers["traceparent"]; ok {
			t.Errorf("message %d: traceparent %v without tracing or a client context", i, tp)
		}
		var payload map[string]any
		if err := json.Unmarshal(m.Body, &payload); err != nil || payload["order_id"] != id {
			t.Errorf("message %d: payload %s", i, m.Body)
		}
	}

	// /metrics shows the relay's counters and the backlog read at scrape time.
	waitMetrics(t, base, "\noutbox_published_total 3\n", "\noutbox_pending 0\n",
		"outbox_confirm_latency_seconds_count", "\noutbox_oldest_pending_age_seconds 0\n")
}

// waitMetrics waits until base's /metrics contains every one of want.
func waitMetrics(t *testing.T, base string, want ...string) {
	t.Helper()
	// A WAL relay is active once its slot exists, and creating a logical
	// slot waits for every transaction open on the server, other tests'
	// included: on a shared server that took over 10 s.
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		text := string(raw)
		missing := slices.DeleteFunc(slices.Clone(want), func(w string) bool { return strings.Contains(text, w) })
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics never showed %q:\n%s", missing, text)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A standalone relay publishes what the API wrote; rows it cannot route are
// dead-lettered after RELAY_MAX_ATTEMPTS, listed by the CLI and the admin
// endpoint, and published once an operator retries them.
func TestStandaloneRelayDeadLettersAndOperatorRetry(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	dbURL := migratedDatabaseURL(t)
	apiAddr := freeAddr(t)
	env := map[string]string{
		"DATABASE_URL": dbURL, "AMQP_URL": amqpURL, "ADMIN_TOKEN": "s3cret",
		"RELAY_POLL_INTERVAL": "50ms", "RELAY_MAX_ATTEMPTS": "2", "RELAY_BACKOFF_MIN": "10ms", "RELAY_BACKOFF_MAX": "20ms",
	}
	apiEnv := map[string]string{"RELAY": "false", "HTTP_ADDR": apiAddr}
	for k, v := range env {
		apiEnv[k] = v
	}
	start(t, apiEnv)
	base := "http://" + apiAddr
	waitReady(t, base)
	start(t, env, "relay")

	// No queue is bound yet: every publish is returned as unroutable.
	var ids []string
	for range 2 {
		status, o := post(t, base+"/orders", orderBody)
		if status != 201 {
			t.Fatalf("create: %d %v", status, o)
		}
		ids = append(ids, o["id"].(string))
	}
	cli := func(args ...string) string {
		t.Helper()
		var out bytes.Buffer
		if err := run(context.Background(), args, func(k string) string { return env[k] }, &out, io.Discard); err != nil {
			t.Fatalf("orders %v: %v", args, err)
		}
		return out.String()
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(cli("outbox-status"), "pending=0 dead_lettered=2") {
		if time.Now().After(deadline) {
			t.Fatalf("rows not dead-lettered: %s", cli("outbox-status"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	list := cli("dead-letters", "list")
	for _, id := range ids {
		if !strings.Contains(list, id) || !strings.Contains(list, "unroutable") {
			t.Fatalf("dead-letters list lacks order %s or its reason:\n%s", id, list)
		}
	}

	// The admin endpoint: token required, then the same dead letters.
	req, _ := http.NewRequest("GET", base+"/admin/outbox/dead-letters", nil)
	if status, _ := doJSON(t, req); status != 401 {
		t.Fatalf("dead letters without token: %d, want 401", status)
	}
	req.Header.Set("Authorization", "Bearer s3cret")
	status, body := doJSON(t, req)
	dls, _ := body["dead_letters"].([]any)
	if status != 200 || len(dls) != 2 {
		t.Fatalf("dead letters: %d %v", status, body)
	}
	sreq, _ := http.NewRequest("GET", base+"/admin/outbox/status", nil)
	sreq.Header.Set("Authorization", "Bearer s3cret")
	if status, st := doJSON(t, sreq); status != 200 || st["dead_lettered"] != float64(2) || st["pending"] != float64(0) {
		t.Fatalf("status: %d %v, want 2 dead letters and nothing pending", status, st)
	}
	first := dls[0].(map[string]any)
	firstID := strconv.FormatInt(int64(first["id"].(float64)), 10)

	deliveries := bindQueue(t, amqpURL)
	if status, body := post(t, base+"/admin/outbox/dead-letters/"+firstID+"/retry", "", "Authorization", "Bearer s3cret"); status != 200 {
		t.Fatalf("retry over HTTP: %d %v", status, body)
	}
	if status, _ := post(t, base+"/admin/outbox/dead-letters/999999/retry", "", "Authorization", "Bearer s3cret"); status != 404 {
		t.Fatalf("retry of an unknown dead letter: %d, want 404", status)
	}
	if m := receive(t, deliveries); !strings.HasPrefix(m.MessageId, firstID+"-") {
		t.Fatalf("after the HTTP retry got message %s, want event %s's", m.MessageId, firstID)
	}
	if out := cli("dead-letters", "retry", "-all"); !strings.Contains(out, "retried 1 dead letters") {
		t.Fatalf("CLI retry: %q", out)
	}
	other := ids[0]
	if other == first["aggregate_id"] {
		other = ids[1]
	}
	if m := receive(t, deliveries); m.Headers["aggregate_id"] != other {
		t.Fatalf("after the CLI retry got %s %v, want the event of order %s", m.MessageId, m.Headers, other)
	}
	deadline = time.Now().Add(20 * time.Second)
	for !strings.Contains(cli("outbox-status"), "pending=0 dead_lettered=0") {
		if time.Now().After(deadline) {
			t.Fatalf("backlog not drained: %s", cli("outbox-status"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

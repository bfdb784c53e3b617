package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// skipOrFail skips when a service the test needs is missing, and fails under
// CI=true, where every service must be there.
func skipOrFail(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}

func testDatabaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
}

func testAMQPURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

func randomSuffix() string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// demoDatabase names a database that does not exist yet (the demo must create
// it) and drops it when the test ends.
func demoDatabase(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, testDatabaseURL())
	if err != nil {
		skipOrFail(t, "PostgreSQL unreachable at %s: %v", testDatabaseURL(), err)
	}
	_ = conn.Close(ctx)
	name := "orders_demotest_" + randomSuffix()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, testDatabaseURL())
		if err != nil {
			t.Errorf("drop %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop %s: %v", name, err)
		}
	})
	u, _ := url.Parse(testDatabaseURL())
	u.Path = "/" + name
	return u.String()
}

// demoVhost creates a RabbitMQ vhost of the test's own, deleted at the end.
func demoVhost(t *testing.T) string {
	t.Helper()
	u, _ := url.Parse(testAMQPURL())
	conn, err := net.DialTimeout("tcp", u.Host, 3*time.Second)
	if err != nil {
		skipOrFail(t, "RabbitMQ unreachable at %s: %v", u.Host, err)
	}
	_ = conn.Close()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		skipOrFail(t, "rabbitmqctl not found (needed to create the test's vhost): %v", err)
	}
	vhost := "demotest-" + randomSuffix()
	user := u.User.Username()
	for _, args := range [][]string{
		{"add_vhost", vhost},
		{"set_permissions", "-p", vhost, user, ".*", ".*", ".*"},
	} {
		if out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput(); err != nil {
			skipOrFail(t, "rabbitmqctl %v: %v: %s", args, err, out)
		}
	}
	t.Cleanup(func() {
		if out, err := exec.Command("rabbitmqctl", "-q", "delete_vhost", vhost).CombinedOutput(); err != nil {
			t.Errorf("delete vhost %s: %v: %s", vhost, err, out)
		}
	})
	u.Path = "/" + vhost
	return u.String()
}

// buildBinaries builds what deploy/demo.sh builds, into a directory of the
// test's own.
func buildBinaries(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "build", "-o", dir+"/", "./services/orders", "./services/shipping", "./cmd/mongolocal", "./cmd/audit", "./deploy/loadgen")
	cmd.Dir = filepath.Join("..", "..")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return dir
}

// freePorts returns n distinct free addresses on 127.0.0.1: every listener
// is held open until all n are taken, so the kernel cannot hand the same
// port out twice (one closed at once can come back at the next call).
func freePorts(t *testing.T, n int) []string {
	t.Helper()
	addrs := make([]string, n)
	for i := range addrs {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		addrs[i] = ln.Addr().String()
	}
	return addrs
}

// runningDemo is one run of the demo in the test process.
type runningDemo struct {
	cancel context.CancelFunc
	done   chan struct{} // closed when run returned, with its error in err
	err    error
	out    *syncBuffer
}

func startDemo(t *testing.T, args []string, env map[string]string) *runningDemo {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	d := &runningDemo{cancel: cancel, done: make(chan struct{}), out: &syncBuffer{}}
	go func() {
		defer close(d.done)
		d.err = run(ctx, args, func(k string) string { return env[k] }, d.out)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-d.done:
		case <-time.After(60 * time.Second):
			t.Errorf("demo still running 60s after cancel")
		}
	})
	deadline := time.Now().Add(2 * time.Minute)
	for !strings.Contains(d.out.String(), "everything is up") {
		select {
		case <-d.done:
			t.Fatalf("demo ended before it was up: %v\n%s", d.err, d.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("demo not up after 2 minutes:\n%s", d.out.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	return d
}

// stop interrupts the demo as Ctrl-C does and checks that it ends cleanly.
func (d *runningDemo) stop(t *testing.T) {
	t.Helper()
	d.cancel()
	select {
	case <-d.done:
		if d.err != nil {
			t.Fatalf("demo ended with %v\n%s", d.err, d.out.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("demo did not stop within 60s\n%s", d.out.String())
	}
	if !strings.Contains(d.out.String(), "all processes stopped") {
		t.Fatalf("no orderly stop reported:\n%s", d.out.String())
	}
}

type shipment struct {
	OrderID string `json:"order_id"`
	Status  string `json:"status"`
	Events  []struct {
		MessageID string `json:"message_id"`
		EventType string `json:"event_type"`
		Version   int64  `json:"version"`
	} `json:"events"`
}

func postJSON(t *testing.T, url, body string, want int) map[string]any {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("POST %s: %s: %s", url, resp.Status, raw)
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatalf("POST %s: %v: %s", url, err, raw)
	}
	return m
}

// waitShipment polls the shipping API until the order's shipment has n events.
func waitShipment(t *testing.T, base, orderID string, n int) shipment {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		resp, err := http.Get(base + "/shipments/" + orderID)
		if err == nil {
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			last = fmt.Sprintf("%s: %s", resp.Status, raw)
			var s shipment
			if resp.StatusCode == http.StatusOK && json.Unmarshal(raw, &s) == nil && len(s.Events) >= n {
				return s
			}
		} else {
			last = err.Error()
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("shipment of %s never had %d events; last answer: %s", orderID, n, last)
	return shipment{}
}

func readPidFile(t *testing.T, stateDir, name string) int {
	t.Helper()
	return readPid(t, pidFilePath(stateDir, name))
}

// The local path of `make demo`, end to end with the real binaries: it
// creates its database, brings everything up, an order and its cancel become
// a shipment with both events in order, a relay killed with SIGKILL comes
// back, Ctrl-C stops every process, and a second run on the same state
// starts again and still has the first run's shipment.
func TestDemoRunsTheSystemLocally(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs every service")
	}
	dbURL := demoDatabase(t)
	amqpURL := demoVhost(t)
	bin := buildBinaries(t)
	state := t.TempDir()
	ports := freePorts(t, 7)
	orders, shipping, relay, relay2, ui, mongo, audit := ports[0], ports[1], ports[2], ports[3], ports[4], ports[5], ports[6]
	args := []string{"-bin", bin, "-state", state, "-orders-addr", orders, "-shipping-addr", shipping,
		"-relay-addr", relay, "-relay2-addr", relay2, "-ui-addr", ui, "-audit-addr", audit}
	env := map[string]string{"DATABASE_URL": dbURL, "AMQP_URL": amqpURL, "MONGO_URI": "mongodb://" + mongo + "/shipping"}

	d := startDemo(t, args, env)
	for _, want := range []string{"http://" + ui, "http://" + orders, "http://" + shipping, "orders_demotest_", "mongodb://" + mongo} {
		if !strings.Contains(d.out.String(), want) {
			t.Errorf("the banner does not say where %s is:\n%s", want, d.out.String())
		}
	}

	o := postJSON(t, "http://"+orders+"/orders",
		`{"customer_id": "c-42", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]}`, http.StatusCreated)
	id, _ := o["id"].(string)
	if id == "" {
		t.Fatalf("order without id: %v", o)
	}
	postJSON(t, "http://"+orders+"/orders/"+id+"/cancel", "", http.StatusOK)
	s := waitShipment(t, "http://"+shipping, id, 2)
	if len(s.Events) != 2 || s.Events[0].EventType != "order.created" || s.Events[1].EventType != "order.cancelled" ||
		s.Events[0].Version != 1 || s.Events[1].Version != 2 {
		t.Fatalf("shipment events = %+v, want order.created v1 then order.cancelled v2", s.Events)
	}

	pids := map[string]int{}
	for _, name := range []string{"mongolocal", "orders", "relay-1", "relay-2", "shipping"} {
		if pids[name] = readPidFile(t, state, name); pids[name] == 0 || !alive(pids[name]) {
			t.Fatalf("%s: no live pid in its pid file", name)
		}
	}
	if err := syscall.Kill(pids["relay-1"], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the relay to come back", func() bool {
		p := readPidFile(t, state, "relay-1")
		return p != 0 && p != pids["relay-1"] && strings.Contains(d.out.String(), "relay-1 restarted")
	})
	newRelay := readPidFile(t, state, "relay-1")

	d.stop(t)
	pids["relay-1"] = newRelay
	for name, pid := range pids {
		if alive(pid) {
			t.Errorf("%s (pid %d) still alive after the demo stopped", name, pid)
		}
	}

	// Again, on the same database, broker and MongoDB data, with the load
	// generator, which is stopped before the services it talks to.
	d = startDemo(t, append(args, "-load", "-load-rate", "50"), env)
	if again := waitShipment(t, "http://"+shipping, id, 2); len(again.Events) != 2 {
		t.Fatalf("after a restart the shipment has %d events, want 2", len(again.Events))
	}
	waitFor(t, "the load generator's first orders", func() bool { return strings.Contains(d.out.String(), "order created") })
	d.stop(t)
	summary := regexp.MustCompile(`loadgen: done in \S+: (\d+) orders created, \d+ cancelled, (\d+) failed requests`).FindStringSubmatch(d.out.String())
	if summary == nil || summary[1] == "0" || summary[2] != "0" {
		t.Fatalf("want a load generator summary with orders created and none failed; got %q\n%s", summary, d.out.String())
	}
}

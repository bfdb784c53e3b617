package main

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// The tests run the command on the real parts: an outbox in a PostgreSQL
// database of the test's own, a relay publishing to the local RabbitMQ
// (exchange and queues of the test's own), the shipping service built from
// this repository consuming them into an embedded FerretDB.
func TestMain(m *testing.M) { goleak.VerifyTestMain(removeBuild{mongotest.Suite(m)}) }

// removeBuild runs the tests, then removes the shipping service they built
// (a binary of tens of megabytes, left in the temporary directory otherwise).
type removeBuild struct{ m mongotest.Runner }

func (r removeBuild) Run() int {
	code := r.m.Run()
	if dir := shippingBuildDir.Load(); dir != nil {
		if err := os.RemoveAll(*dir); err != nil {
			fmt.Fprintf(os.Stderr, "remove the shipping build: %v\n", err)
			code = max(code, 1)
		}
	}
	return code
}

func databaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
}

func amqpURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

func unavailable(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf(format+" (required under CI=true)", args...)
	}
	t.Skipf(format, args...)
}

func randomName(prefix string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// newDatabase creates a PostgreSQL database with the outbox tables, dropped
// when the test ends, and returns its URL and a pool on it.
func newDatabase(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	ctx := t.Context()
	admin, err := pgx.Connect(ctx, databaseURL())
	if err != nil {
		unavailable(t, "PostgreSQL unreachable at %s: %v", databaseURL(), err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	name := randomName("audit_test_")
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("create database: %v", err)
	}
	u, err := url.Parse(databaseURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, databaseURL())
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	if err := outbox.Migrate(ctx, pool); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return u.String(), pool
}

// mongoDatabase returns a fresh database on the embedded FerretDB and its
// URI, with the database as its path (how MONGO_URI names it).
func mongoDatabase(t *testing.T) (*mongo.Database, string) {
	t.Helper()
	db := mongotest.Database(t)
	u, err := url.Parse(mongotest.URI(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + db.Name()
	return db, u.String()
}

// runAudit runs the command once with args and returns its report and
// error.
func runAudit(t *testing.T, dbURL, mongoURI string, args ...string) (*audit.Report, error) {
	t.Helper()
	var out bytes.Buffer
	env := map[string]string{"DATABASE_URL": dbURL, "MONGO_URI": mongoURI}
	err := run(t.Context(), args, func(k string) string { return env[k] }, &out)
	if err != nil && !errors.Is(err, errNotWhole) {
		t.Fatalf("audit %v: %v\n%s", args, err, out.String())
	}
	var r audit.Report
	if jerr := json.Unmarshal(out.Bytes(), &r); jerr != nil {
		t.Fatalf("audit %v: the report is not JSON: %v\n%s", args, jerr, out.String())
	}
	return &r, err
}

// window is the -since/-until pair around now that judges every event of a
// test.
var window = []string{"-since", "1h", "-until", "0s"}

// shippingBuildDir is where shippingBinary built the shipping service, if it
// did: TestMain removes it once the tests ran.
var shippingBuildDir atomic.Pointer[string]

// shippingBinary builds the shipping service once per test binary.
var shippingBinary = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "audit-test-shipping-")
	if err != nil {
		return "", err
	}
	shippingBuildDir.Store(&dir)
	bin := filepath.Join(dir, "shipping")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/outbox-inbox/reference/services/shipping")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./services/shipping: %v\n%s", err, out)
	}
	return bin, nil
})

// flow is an outbox, a relay publishing to RabbitMQ, and the shipping
// service consuming into FerretDB.
type flow struct {
	t          *testing.T
	dbURL      string
	pool       *pgxpool.Pool
	mongo      *mongo.Database
	mongoURI   string
	exchange   string
	shipping   string // its HTTP address
	adminToken string
	stopRelay  func()
}

// Routing keys the relay's test routing sends some aggregates to.
const (
	lostPrefix    = "lost-"    // routed to a queue nobody consumes: confirmed, never applied
	nowherePrefix = "nowhere-" // routed nowhere: returned, dead-lettered
)

func newFlow(t *testing.T) *flow {
	t.Helper()
	f := &flow{t: t, exchange: randomName("audit.events."), adminToken: randomName("token-")}
	f.dbURL, f.pool = newDatabase(t)
	f.mongo, f.mongoURI = mongoDatabase(t)

	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		unavailable(t, "RabbitMQ unreachable at %s: %v", amqpURL(), err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	queue, blackhole, dlx := randomName("audit.shipping."), randomName("audit.blackhole."), randomName("audit.dlx.")
	if err := ch.ExchangeDeclare(f.exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(blackhole, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(blackhole, "lost.#", f.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range []string{queue, queue + ".dlq", queue + ".delay", blackhole} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		for _, x := range []string{f.exchange, dlx} {
			_ = ch.ExchangeDelete(x, false, false)
		}
	})

	bin, err := shippingBinary()
	if err != nil {
		t.Fatal(err)
	}
	f.shipping = startShipping(t, bin, []string{"-exchange", f.exchange, "-queue", queue, "-dead-letter-exchange", dlx, "-delay", "100ms"},
		"AMQP_URL="+amqpURL(), "MONGO_URI="+f.mongoURI, "ADMIN_TOKEN="+f.adminToken)
	f.startRelay()
	return f
}

// startShipping runs the service until the test ends and returns its HTTP
// address once it is ready.
func startShipping(t *testing.T, bin string, args []string, env ...string) string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), append(env, "HTTP_ADDR=127.0.0.1:0", "LOG_LEVEL=info")...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var logs safeBuffer
	done := make(chan error, 1)
	addr := listening(out, &logs, "http_addr", func() { done <- cmd.Wait() })
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("shipping's logs:\n%s", logs.String())
		}
	})
	var a string
	select {
	case a = <-addr:
	case err := <-done:
		t.Fatalf("shipping exited before listening: %v\n%s", err, logs.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("shipping did not listen within 60s\n%s", logs.String())
	}
	waitFor(t, "shipping ready", func() bool {
		resp, err := http.Get("http://" + a + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return a
}

// listening reads JSON log lines from r into logs until r ends, then calls
// end; the returned channel receives the address (the field key) of the
// "listening" line.
func listening(r io.Reader, logs *safeBuffer, key string, end func()) <-chan string {
	addr := make(chan string, 1)
	go func() {
		lines := bufio.NewScanner(r)
		for lines.Scan() {
			logs.write(lines.Text() + "\n")
			var rec map[string]any
			if json.Unmarshal(lines.Bytes(), &rec) == nil && rec["msg"] == "listening" {
				a, _ := rec[key].(string)
				addr <- a
			}
		}
		end()
	}()
	return addr
}

type safeBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *safeBuffer) write(p string) { s.mu.Lock(); s.b.WriteString(p); s.mu.Unlock() }
func (s *safeBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startRelay runs a relay publishing the outbox to the flow's exchange: an
// aggregate named lost-... goes to a queue nobody consumes, nowhere-... to
// no queue at all (returned, and dead-lettered after one attempt).
func (f *flow) startRelay() {
	t := f.t
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{
		URL: amqpURL(), Exchange: f.exchange, Logger: slog.New(slog.DiscardHandler),
		RoutingKey: func(e outbox.Envelope) string {
			switch {
			case strings.HasPrefix(e.AggregateID, lostPrefix):
				return "lost." + e.EventType
			case strings.HasPrefix(e.AggregateID, nowherePrefix):
				return "nowhere." + e.EventType
			}
			return e.EventType
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(f.pool, pub, outbox.RelayConfig{
		PollInterval: 20 * time.Millisecond, MaxAttempts: 1, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once sync.Once
	f.stopRelay = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("relay: %v", err)
			}
			_ = pub.Close()
		})
	}
	t.Cleanup(f.stopRelay)
}

// order enqueues an order's events: order.created, and order.cancelled
// when cancel is set, each version in a transaction of its own. A poison
// order.created has a payload shipping refuses.
func (f *flow) order(id string, cancel, poison bool) (ids []string) {
	f.t.Helper()
	customer := "c-1"
	if poison {
		customer = ""
	}
	events := []outbox.Message{{AggregateType: "order", AggregateID: id, EventType: "order.created",
		Payload: fmt.Appendf(nil, `{"order_id":%q,"customer_id":%q,"currency":"EUR","items":[{"sku":"s","quantity":1,"unit_price":100}],"total":100}`, id, customer)}}
	if cancel {
		events = append(events, outbox.Message{AggregateType: "order", AggregateID: id, EventType: "order.cancelled",
			Payload: fmt.Appendf(nil, `{"order_id":%q}`, id)})
	}
	for _, m := range events {
		err := pgx.BeginFunc(f.t.Context(), f.pool, func(tx pgx.Tx) error {
			e, err := new(outbox.Writer).Enqueue(f.t.Context(), tx, m)
			for _, x := range e {
				ids = append(ids, fmt.Sprint(x.ID))
			}
			return err
		})
		if err != nil {
			f.t.Fatalf("enqueue: %v", err)
		}
	}
	return ids
}

// recorded returns how many messages shipping's inbox recorded as done.
func (f *flow) recorded() int {
	in, err := inbox.New(f.mongo, inbox.Config{Consumer: "shipping"})
	if err != nil {
		return 0
	}
	n := 0
	for _, err := range in.Recorded(f.t.Context(), time.Time{}, 0) {
		if err != nil {
			return 0
		}
		n++
	}
	return n
}

// shipmentEvents returns how many events shipping applied to an order.
func (f *flow) shipmentEvents(orderID string) int {
	resp, err := http.Get("http://" + f.shipping + "/shipments/" + orderID)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var s struct {
		Events []json.RawMessage `json:"events"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&s) != nil {
		return 0
	}
	return len(s.Events)
}

// deadLetters returns shipping's dead letters and parked messages.
func (f *flow) deadLetters() (letters, parked int) {
	req, _ := http.NewRequest(http.MethodGet, "http://"+f.shipping+"/admin/dead-letters", nil)
	req.Header.Set("Authorization", "Bearer "+f.adminToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0
	}
	defer resp.Body.Close()
	var body struct {
		DeadLetters []json.RawMessage `json:"dead_letters"`
		Held        []struct {
			Parked int `json:"parked"`
		} `json:"held_orders"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&body) != nil {
		return 0, 0
	}
	for _, h := range body.Held {
		parked += h.Parked
	}
	return len(body.DeadLetters), parked
}

// examples lists b's examples by outbox id: a message id is the id and the
// event's creation time ("12-1764662400123456").
func examples(b audit.Bucket) string {
	ex := slices.Clone(b.Examples)
	for i, msgID := range ex {
		if id, _, err := outbox.ParseMessageID(msgID); err == nil {
			ex[i] = strconv.FormatInt(id, 10)
		}
	}
	slices.Sort(ex)
	return strings.Join(ex, " ")
}

func wantBuckets(t *testing.T, what string, r *audit.Report, want map[string]string) {
	t.Helper()
	for name, b := range r.Buckets() {
		if got := examples(*b); got != want[name] || b.Count != int64(len(b.Examples)) {
			t.Errorf("%s: %s: %d, examples %q; want %q", what, name, b.Count, got, want[name])
		}
	}
}

func sorted(ids ...string) string {
	slices.Sort(ids)
	return strings.Join(ids, " ")
}

// A flow without a fault is whole; then each kind of damage, on each side,
// lands in its own bucket, and the command exits non-zero for missing
// events and phantom records only.
func TestAuditOfTheRealFlow(t *testing.T) {
	t.Parallel()
	f := newFlow(t)
	a, b := randomName("o-"), randomName("o-")
	applied := append(f.order(a, true, false), f.order(b, false, false)...)
	// Shipping applies an event, then records it: wait for both.
	waitFor(t, "shipping applied and recorded the orders", func() bool {
		return f.shipmentEvents(a) == 2 && f.shipmentEvents(b) == 1 && f.recorded() == 3
	})

	r, err := runAudit(t, f.dbURL, f.mongoURI, window...)
	if err != nil || !r.Whole() || r.Checked != 3 || examples(r.Applied) != sorted(applied...) {
		t.Fatalf("clean flow: err %v, report %+v; want whole, 3 applied (%v)", err, r, applied)
	}

	// Producer side: an event the broker confirmed and that never reached
	// shipping (routed to a queue nobody reads), one dead-lettered by the
	// relay, one dead-lettered and discarded by an operator.
	lost := f.order(randomName(lostPrefix), false, false)
	dead := f.order(randomName(nowherePrefix), false, false)
	discarded := f.order(randomName(nowherePrefix), false, false)
	// Consumer side: a message shipping dead-letters (its payload is
	// invalid) and the next event of its order, parked behind it.
	poison := f.order(randomName("o-"), true, true)
	waitFor(t, "the relay's verdicts and shipping's dead letters", func() bool {
		s, err := outboxadmin.New(f.pool).Status(t.Context())
		letters, parked := f.deadLetters()
		return err == nil && s.DeadLettered == 2 && s.Pending == 0 && letters == 1 && parked == 1
	})
	var discardedID int64
	fmt.Sscan(discarded[0], &discardedID)
	if err := outboxadmin.New(f.pool).Discard(t.Context(), discardedID, "test"); err != nil {
		t.Fatal(err)
	}
	// An event committed while no relay runs: pending, within the grace.
	f.stopRelay()
	pending := f.order(randomName("o-"), false, false)

	// Missing events alone make the command fail.
	r, err = runAudit(t, f.dbURL, f.mongoURI, append(window, "-grace", "1ns")...)
	if !errors.Is(err, errNotWhole) || r.Phantom.Count != 0 || examples(r.Missing) != sorted(append(lost, pending...)...) {
		t.Fatalf("missing only: %v, missing %v, phantom %v", err, r.Missing, r.Phantom)
	}

	// Inbox records no event was committed for, written by shipping's inbox.
	in, err := inbox.New(f.mongo, inbox.Config{Consumer: "shipping"})
	if err != nil {
		t.Fatal(err)
	}
	// The last is the message id of an event a failover lost: the id of an
	// event the outbox holds, created at another time.
	var appliedID int64
	fmt.Sscan(applied[0], &appliedID)
	lostByFailover := outbox.MessageID(appliedID, time.Now().Add(-30*time.Minute))
	for _, id := range []string{"987654321", "not-an-outbox-id", lostByFailover} {
		if _, err := in.Process(t.Context(), id, func(context.Context) error { return nil }); err != nil {
			t.Fatal(err)
		}
	}

	// Within the grace, what did not arrive is pending: the lost event (it
	// may still be on its way) and the one no relay published.
	r, err = runAudit(t, f.dbURL, f.mongoURI, window...)
	if !errors.Is(err, errNotWhole) {
		t.Fatalf("audit after the damage: %v, want errNotWhole (phantoms)", err)
	}
	want := map[string]string{
		"applied": sorted(applied...), "missing": "", "dead_lettered": sorted(dead...),
		"discarded": sorted(discarded...), "held": sorted(poison...), "pending": sorted(append(lost, pending...)...),
		"phantom": sorted("987654321", "not-an-outbox-id", applied[0]), "unrecorded": "",
	}
	wantBuckets(t, "within the grace", r, want)
	if r.Checked != 9 {
		t.Errorf("checked %d, want 9", r.Checked)
	}

	// Past the grace, they are missing.
	r, err = runAudit(t, f.dbURL, f.mongoURI, append(window, "-grace", "1ns")...)
	if !errors.Is(err, errNotWhole) {
		t.Fatalf("audit past the grace: %v, want errNotWhole", err)
	}
	want["missing"], want["pending"] = want["pending"], ""
	wantBuckets(t, "past the grace", r, want)

	// Without shipping's stores, what shipping holds is missing too.
	r, _ = runAudit(t, f.dbURL, f.mongoURI, append(window, "-grace", "1ns", "-accounting=false")...)
	want["missing"], want["held"] = sorted(append(append(lost, pending...), poison...)...), ""
	wantBuckets(t, "-accounting=false", r, want)
	// A window that ends before the events judges none of them, and reads
	// the inbox records of the later ones without calling them phantoms.
	r, _ = runAudit(t, f.dbURL, f.mongoURI, "-since", "1h", "-until", "30m")
	if r.Checked != 0 || examples(r.Phantom) != sorted("987654321", "not-an-outbox-id", applied[0]) {
		t.Errorf("window before the events: checked %d, phantom %q", r.Checked, examples(r.Phantom))
	}
}

// -every audits periodically and serves the counts and the last report;
// the command stops when its context ends.
func TestContinuousModeServesGauges(t *testing.T) {
	t.Parallel()
	dbURL, pool := newDatabase(t)
	db, mongoURI := mongoDatabase(t)
	err := pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(t.Context(), tx, outbox.Message{AggregateType: "order", AggregateID: "o-1", EventType: "order.created", Payload: []byte(`{}`)})
	})
	if err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Process(t.Context(), "42", func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	r, w := io.Pipe()
	env := map[string]string{"DATABASE_URL": dbURL, "MONGO_URI": mongoURI}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append(window, "-every", "1s", "-metrics-addr", "127.0.0.1:0"), func(k string) string { return env[k] }, w)
		_ = w.Close()
	}()
	var logs safeBuffer
	addr := listening(r, &logs, "metrics_addr", func() {})
	var a string
	select {
	case a = <-addr:
	case err := <-done:
		t.Fatalf("run returned %v before listening\n%s", err, logs.String())
	}
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + a + path)
		if err != nil {
			return 0, ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	waitFor(t, "the gauges of an audit", func() bool {
		_, m := get("/metrics")
		return strings.Contains(m, `audit_events{bucket="phantom"} 1`) && strings.Contains(m, `audit_events{bucket="pending"} 1`)
	})
	_, m := get("/metrics")
	for _, want := range []string{`audit_checked_events 1`, `audit_events{bucket="missing"} 0`, `audit_runs_total{result="not_whole"}`, `audit_last_success_timestamp_seconds`} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %q:\n%s", want, m)
		}
	}
	// The next cycles are incremental: an event committed and applied
	// now is read above the watermark and found by its message id; the
	// phantom, found by the first (full) cycle, is carried.
	var second []outbox.Enqueued
	err = pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		second, err = new(outbox.Writer).Enqueue(t.Context(), tx, outbox.Message{AggregateType: "order", AggregateID: "o-2", EventType: "order.created", Payload: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Process(t.Context(), outbox.MessageID(second[0].ID, second[0].CreatedAt), func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "an incremental cycle that counts the new event applied", func() bool {
		_, m := get("/metrics")
		return strings.Contains(m, `audit_checked_events 2`) && strings.Contains(m, `audit_events{bucket="applied"} 1`) &&
			strings.Contains(m, `audit_events{bucket="phantom"} 1`) && strings.Contains(m, `audit_events{bucket="pending"} 1`)
	})
	// The alerts read only metrics the audit exports.
	rules, err := os.ReadFile("../../deploy/prometheus/rules/audit.yml")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, line := range strings.Split(string(rules), "\n") {
		if strings.Contains(line, "expr:") {
			names = append(names, regexp.MustCompile(`\b(audit|process)_[a-z_]+`).FindAllString(line, -1)...)
		}
	}
	if len(names) == 0 {
		t.Fatal("deploy/prometheus/rules/audit.yml names no audit_ metric")
	}
	for _, name := range names {
		if !strings.Contains(m, "\n"+name+" ") && !strings.Contains(m, "\n"+name+"{") {
			t.Errorf("rules/audit.yml reads %s, which /metrics does not export", name)
		}
	}
	code, body := get("/report")
	var rep audit.Report
	if code != http.StatusOK || json.Unmarshal([]byte(body), &rep) != nil || rep.Phantom.Count != 1 || rep.Pending.Count != 1 {
		t.Errorf("GET /report: %d %s", code, body)
	}
	if !strings.Contains(logs.String(), "the flow is not whole") {
		t.Errorf("no log line says the flow is not whole:\n%s", logs.String())
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
}

func TestBadArguments(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"-since", "yesterday"},
		{"-grace", "0s"},
		{"-every", "10ms"},
		{"-page-size", "0"},
		{"-retention", "20m"},
		{"extra"},
	} {
		err := run(t.Context(), args, func(string) string { return "" }, io.Discard)
		if err == nil || errors.Is(err, errNotWhole) {
			t.Errorf("%v: %v, want an error", args, err)
		}
	}
	if err := run(t.Context(), []string{"-h"}, func(string) string { return "" }, io.Discard); err != nil {
		t.Errorf("-h: %v", err)
	}
	if err := run(t.Context(), nil, func(k string) string { return map[string]string{"OUTBOX_RETENTION": "soon"}[k] }, io.Discard); err == nil {
		t.Error("OUTBOX_RETENTION=soon: want an error")
	}
}

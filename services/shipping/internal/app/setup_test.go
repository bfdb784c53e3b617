package app_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/internal/mongolocal/replsettest"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/processor"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// These tests run the whole service against the local RabbitMQ (a vhost per
// test) and the embedded FerretDB (a database per test); the tests of
// appSuite run again in transaction mode on a replica set where one is
// available (TestAppSuiteInTransactionMode).
func TestMain(m *testing.M) { goleak.VerifyTestMain(replsettest.Suite(m)) }

// env is one test's world: a vhost, a database, a publisher, and the
// service instances started on them.
type env struct {
	t        *testing.T
	vhost    string
	amqpURL  string
	mongoURI string
	db       *mongo.Database
	store    *mongodb.Store
	inbox    *inbox.Inbox
	pub      *publisher
	logs     *logBuffer
	apps     []*app.App
	// order records, per order, the versions the service applied, in the
	// order it applied them (every app of the env applies through it).
	order *applyRecorder
}

// newEnv is an env on the embedded FerretDB (the inbox's standalone mode).
func newEnv(t *testing.T) *env {
	t.Helper()
	db := mongotest.Database(t)
	return newEnvOn(t, db, mongotest.URI(t)+db.Name())
}

// newReplSetEnv is an env on a replica set (the inbox's transaction mode),
// or skips the test when there is none (see replsettest).
func newReplSetEnv(t *testing.T) *env {
	t.Helper()
	db := replsettest.Database(t)
	u, err := url.Parse(replsettest.URI(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + db.Name()
	e := newEnvOn(t, db, u.String())
	if mode, err := e.inbox.Mode(t.Context()); err != nil || mode != inbox.ModeTransaction {
		t.Fatalf("inbox mode on the replica set: %q, %v; want %q", mode, err, inbox.ModeTransaction)
	}
	return e
}

func newEnvOn(t *testing.T, db *mongo.Database, uri string) *env {
	t.Helper()
	vhost, amqpURL := amqptest.VHost(t)
	store, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, vhost: vhost, amqpURL: amqpURL, mongoURI: uri, db: db, store: store, inbox: in, logs: &logBuffer{}, order: &applyRecorder{}}
	e.pub = newPublisher(t, amqpURL)
	return e
}

// start runs a service instance on the env until the test ends.
func (e *env) start(cfg app.Config) *app.App {
	e.t.Helper()
	cfg.AMQPURL = e.amqpURL
	cfg.MongoURI = e.mongoURI
	cfg.HTTPAddr = "127.0.0.1:0"
	if cfg.Topology.Delay == 0 {
		cfg.Topology.Delay = 100 * time.Millisecond
	}
	if e.order != nil {
		wrap := cfg.WrapStore
		cfg.WrapStore = func(s processor.Store) processor.Store {
			if wrap != nil {
				s = wrap(s)
			}
			return e.order.wrap(s)
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelInfo})).With("instance", len(e.apps))
	}
	a, err := app.New(cfg)
	if err != nil {
		e.t.Fatalf("app.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(e.t.Context()))
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	e.t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				e.t.Errorf("Run: %v", err)
			}
		case <-time.After(60 * time.Second):
			e.t.Errorf("Run did not return 60s after cancel")
		}
		if e.t.Failed() || os.Getenv("SHIPPING_TEST_LOGS") != "" {
			e.t.Logf("service logs:\n%s", e.logs.String())
		}
	})
	e.apps = append(e.apps, a)
	waitFor(e.t, 30*time.Second, "consumer ready", func() bool { return a.Ready() == nil })
	return a
}

// shipment returns the order's shipment, or ok false when it has none.
func (e *env) shipment(orderID string) (shipment.Shipment, bool) {
	e.t.Helper()
	s, err := e.store.Get(e.t.Context(), orderID)
	if err != nil {
		return shipment.Shipment{}, false
	}
	return s, true
}

// waitShipment waits until the order's shipment has n events.
func (e *env) waitShipment(orderID string, n int) shipment.Shipment {
	e.t.Helper()
	var s shipment.Shipment
	waitFor(e.t, 60*time.Second, fmt.Sprintf("shipment %s with %d events", orderID, n), func() bool {
		var ok bool
		s, ok = e.shipment(orderID)
		return ok && len(s.Events) >= n
	})
	return s
}

// waitDrained waits until the main and delay queues hold nothing, acked or not.
func (e *env) waitDrained(a *app.App) {
	e.t.Helper()
	top := a.Topology()
	waitFor(e.t, 60*time.Second, "queues drained", func() bool {
		r1, u1 := amqptest.QueueCounts(e.t, e.vhost, top.Queue)
		r2, u2 := amqptest.QueueCounts(e.t, e.vhost, top.DelayQueue)
		return r1+u1+r2+u2 == 0
	})
}

// sum adds a metric over every instance.
func (e *env) sum(f func(a *app.App) float64) float64 {
	var total float64
	for _, a := range e.apps {
		total += f(a)
	}
	return total
}

func value(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

func gaugeValue(g prometheus.Gauge) float64 {
	var m dto.Metric
	_ = g.Write(&m)
	return m.GetGauge().GetValue()
}

func processed(a *app.App) float64   { return value(a.Metrics().Processed) }
func dupInbox(a *app.App) float64    { return value(a.Metrics().Duplicates.WithLabelValues("inbox")) }
func dupVersion(a *app.App) float64  { return value(a.Metrics().Duplicates.WithLabelValues("version")) }
func deferredGap(a *app.App) float64 { return value(a.Metrics().Deferred.WithLabelValues("gap")) }

// wantCounted waits up to 10 s for c to reach want, then holds it to want
// exactly. The consumer counts a dead letter or a deferral once the broker
// has confirmed its copy, which a queue may show a moment before.
func wantCounted(t *testing.T, what string, c prometheus.Counter, want float64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for value(c) < want && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := value(c); n != want {
		t.Errorf("%s counted %v, want %v", what, n, want)
	}
}

func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// applyRecorder records, per order, the versions Store.Apply applied, in
// the order its calls returned. Unlike Store.Get, which stops at the first
// missing version, it sees a version applied before the one it follows.
//
// Two consumers can apply version 1 and then version 2 of an order and
// return in the other order: each call is recorded with a step taken before
// it and one after, and a version counts as applied before its predecessor
// only when its call returned before the predecessor's call began.
type applyRecorder struct {
	mu      sync.Mutex
	step    int64
	applied map[string][]appliedVersion
}

// appliedVersion is one call of Store.Apply that applied version: began
// and ended are steps of the recorder.
type appliedVersion struct {
	version      int64
	began, ended int64
}

func (r *applyRecorder) wrap(s processor.Store) processor.Store { return recordingStore{s, r} }

func (r *applyRecorder) next() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.step++
	return r.step
}

// versions returns the versions applied to orderID, in the order their
// calls returned.
func (r *applyRecorder) versions(orderID string) []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []int64
	for _, a := range r.applied[orderID] {
		out = append(out, a.version)
	}
	return out
}

// waitVersions waits until n versions of orderID were recorded and returns
// them. A test that saw the shipment's last version in the store still
// waits: the recorder notes a call once Store.Apply has returned, after its
// write is visible.
func (r *applyRecorder) waitVersions(t *testing.T, orderID string, n int) []int64 {
	t.Helper()
	var vs []int64
	waitFor(t, 10*time.Second, fmt.Sprintf("%d applications of %s recorded", n, orderID), func() bool {
		vs = r.versions(orderID)
		return len(vs) >= n
	})
	return vs
}

// wantInOrder fails unless every order's versions were applied in the order
// 1, 2, 3, ...: no version's call returned before its predecessor's call
// began (in transaction mode an attempt that was rolled back may be seen
// again: a version may repeat).
func (r *applyRecorder) wantInOrder(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for order, as := range r.applied {
		began := map[int64]int64{} // each version's first call
		for _, a := range as {
			if b, ok := began[a.version]; !ok || a.began < b {
				began[a.version] = a.began
			}
		}
		var vs []int64
		for _, a := range as {
			vs = append(vs, a.version)
		}
		for _, a := range as {
			if a.version == 1 {
				continue
			}
			if b, ok := began[a.version-1]; !ok || b > a.ended {
				t.Errorf("order %s: version %d applied before version %d (application order %v)", order, a.version, a.version-1, vs)
				break
			}
		}
	}
}

type recordingStore struct {
	processor.Store
	r *applyRecorder
}

func (s recordingStore) Apply(ctx context.Context, msgID string, ev shipment.Event) (shipment.Outcome, error) {
	began := s.r.next()
	o, err := s.Store.Apply(ctx, msgID, ev)
	if err == nil && o == shipment.OutcomeApplied {
		ended := s.r.next()
		s.r.mu.Lock()
		if s.r.applied == nil {
			s.r.applied = map[string][]appliedVersion{}
		}
		s.r.applied[ev.OrderID] = append(s.r.applied[ev.OrderID], appliedVersion{version: ev.Version, began: began, ended: ended})
		s.r.mu.Unlock()
	}
	return o, err
}

// wantEvents fails unless s's events are exactly want (message ids, in order).
func wantEvents(t *testing.T, s shipment.Shipment, want ...string) {
	t.Helper()
	var got []string
	for i, ev := range s.Events {
		got = append(got, ev.MessageID)
		if ev.Version != int64(i+1) {
			t.Errorf("shipment %s: event %d has version %d", s.OrderID, i, ev.Version)
		}
	}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("shipment %s events %v, want %v (each exactly once, in order)", s.OrderID, got, want)
	}
}

// event is one message as the orders relay publishes it (docs/events.md).
type event struct {
	MessageID string
	Type      string
	OrderID   string
	Version   any // aggregate_version header; nil leaves it out
	Body      []byte
	Headers   amqp.Table // extra or overriding headers
	// Untyped leaves the AMQP type property empty: the type is then only in
	// the routing key (and the event_type header, unless Headers removes it).
	Untyped bool
}

func created(msgID, orderID string) event {
	body, _ := json.Marshal(map[string]any{
		"order_id": orderID, "customer_id": "c-42", "currency": "EUR",
		"items": []map[string]any{{"sku": "sku-1", "quantity": 2, "unit_price": 1250}},
		"total": 2500, "created_at": "2026-11-29T22:00:00Z",
	})
	return event{MessageID: msgID, Type: shipment.TypeCreated, OrderID: orderID, Version: int64(1), Body: body}
}

func cancelled(msgID, orderID string) event {
	body, _ := json.Marshal(map[string]any{"order_id": orderID, "cancelled_at": "2026-11-29T22:01:00Z"})
	return event{MessageID: msgID, Type: shipment.TypeCancelled, OrderID: orderID, Version: int64(2), Body: body}
}

// publisher publishes events with confirms, reconnecting (and republishing
// the unconfirmed message, as a relay does) when its connection is cut.
type publisher struct {
	t    *testing.T
	url  string
	mu   sync.Mutex
	conn *amqp.Connection
	ch   *amqp.Channel
}

func newPublisher(t *testing.T, url string) *publisher {
	p := &publisher{t: t, url: url}
	t.Cleanup(func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.conn != nil {
			_ = p.conn.Close()
		}
	})
	return p
}

func (p *publisher) connect() error {
	if p.conn != nil && !p.conn.IsClosed() && p.ch != nil && !p.ch.IsClosed() {
		return nil
	}
	if p.conn != nil {
		_ = p.conn.Close()
	}
	conn, err := amqp.Dial(p.url)
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return err
	}
	if err := ch.Confirm(false); err != nil {
		_ = conn.Close()
		return err
	}
	// Same declaration as the service: whoever comes first creates it.
	if err := ch.ExchangeDeclare("orders.events", amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		_ = conn.Close()
		return err
	}
	p.conn, p.ch = conn, ch
	return nil
}

// publish sends ev to orders.events and waits for its confirm, retrying
// through connection cuts for up to 30s.
func (p *publisher) publish(ev event) {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	h := amqp.Table{"aggregate_type": "order", "aggregate_id": ev.OrderID, "event_type": ev.Type}
	if ev.Version != nil {
		h["aggregate_version"] = ev.Version
	}
	for k, v := range ev.Headers {
		if v == nil {
			delete(h, k)
		} else {
			h[k] = v
		}
	}
	typ := ev.Type
	if ev.Untyped {
		typ = ""
	}
	msg := amqp.Publishing{
		MessageId: ev.MessageID, Type: typ, ContentType: "application/json",
		DeliveryMode: amqp.Persistent, Timestamp: time.Now(), Headers: h, Body: ev.Body,
	}
	key := ev.Type
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := p.connect()
		if err == nil {
			var dc *amqp.DeferredConfirmation
			dc, err = p.ch.PublishWithDeferredConfirmWithContext(p.t.Context(), "orders.events", key, false, false, msg)
			if err == nil {
				ctx, cancel := context.WithTimeout(p.t.Context(), 10*time.Second)
				var ok bool
				ok, err = dc.WaitContext(ctx)
				cancel()
				if err == nil && ok {
					return
				}
				if err == nil {
					err = fmt.Errorf("nacked")
				}
			}
		}
		if time.Now().After(deadline) {
			p.t.Errorf("publish %s: %v", ev.MessageID, err)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// deadLetters reads (and removes) every message in the dead-letter queue.
func (e *env) deadLetters(queue string) []amqp.Delivery {
	e.t.Helper()
	conn, err := amqp.Dial(e.amqpURL)
	if err != nil {
		e.t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		e.t.Fatalf("channel: %v", err)
	}
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			e.t.Fatalf("get %s: %v", queue, err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// logBuffer collects the service's logs for assertions and failure output.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func amended(msgID, orderID string, version int64) event {
	body, _ := json.Marshal(map[string]any{"order_id": orderID, "note": "amendment " + msgID, "amended_at": "2026-11-29T22:00:30Z"})
	return event{MessageID: msgID, Type: shipment.TypeAmended, OrderID: orderID, Version: version, Body: body}
}

package outboxamqp_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// Helpers shared with pkg/outbox's tests: a migrated schema of each test's
// own, enqueueing, waiting on a condition.
var (
	testDatabaseURL = outboxtest.DatabaseURL
	unavailable     = outboxtest.Unavailable
	newTestPool     = outboxtest.Pool
	msg             = outboxtest.Msg
	enqueue         = outboxtest.Enqueue
	waitFor         = outboxtest.WaitFor
	outboxEmpty     = outboxtest.OutboxEmpty
	startRelay      = outboxtest.StartRelay
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func testAMQPURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

func randomName(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// broker is a test's own exchange and queue (bound with "#") on the test broker,
// deleted in cleanup, and a consumer that records every delivery.
type broker struct {
	t        testing.TB
	conn     *amqp.Connection
	ch       *amqp.Channel
	exchange string
	queue    string

	mu       sync.Mutex
	received []amqp.Delivery
	changed  chan struct{} // closed and replaced on every delivery
}

// newBroker declares an exchange, and unless unbound, a durable queue bound to it
// that the test consumes in the background.
func newBroker(t testing.TB, bound bool) *broker {
	t.Helper()
	conn, err := amqp.Dial(testAMQPURL())
	if err != nil {
		unavailable(t, "RabbitMQ at "+testAMQPURL(), err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	b := &broker{t: t, conn: conn, ch: ch, exchange: randomName("outboxamqp-test-"), changed: make(chan struct{})}
	b.queue = b.exchange + ".q"
	if err := ch.ExchangeDeclare(b.exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := ch.QueueDelete(b.queue, false, false, false); err != nil {
			t.Errorf("delete queue: %v", err)
		}
		if err := ch.ExchangeDelete(b.exchange, false, false); err != nil {
			t.Errorf("delete exchange: %v", err)
		}
		_ = conn.Close()
	})
	if bound {
		b.bind("#", nil)
	}
	return b
}

// bind declares the test's queue (with args on first declaration) and binds it
// with key, then consumes it in the background.
func (b *broker) bind(key string, args amqp.Table) {
	b.t.Helper()
	if _, err := b.ch.QueueDeclare(b.queue, true, false, false, false, args); err != nil {
		b.t.Fatal(err)
	}
	if err := b.ch.QueueBind(b.queue, key, b.exchange, false, nil); err != nil {
		b.t.Fatal(err)
	}
	if args != nil {
		return // a queue with limits is inspected, not consumed
	}
	deliveries, err := b.ch.Consume(b.queue, "", true, false, false, false, nil)
	if err != nil {
		b.t.Fatal(err)
	}
	go func() {
		for d := range deliveries {
			b.mu.Lock()
			b.received = append(b.received, d)
			close(b.changed)
			b.changed = make(chan struct{})
			b.mu.Unlock()
		}
	}()
}

func (b *broker) deliveries() []amqp.Delivery {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]amqp.Delivery(nil), b.received...)
}

// waitDeliveries waits until cond holds on the deliveries so far.
func (b *broker) waitDeliveries(what string, timeout time.Duration, cond func([]amqp.Delivery) bool) []amqp.Delivery {
	b.t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		b.mu.Lock()
		got, changed := append([]amqp.Delivery(nil), b.received...), b.changed
		b.mu.Unlock()
		if cond(got) {
			return got
		}
		select {
		case <-changed:
		case <-deadline.C:
			b.t.Fatalf("timed out after %v waiting for %s (%d deliveries)", timeout, what, len(got))
		}
	}
}

// receivedIDs counts deliveries per message id.
func receivedIDs(ds []amqp.Delivery) map[int64]int {
	out := map[int64]int{}
	for _, d := range ds {
		id, _, _ := outbox.ParseMessageID(d.MessageId)
		out[id]++
	}
	return out
}

func newPublisher(t testing.TB, url, exchange string, log *slog.Logger) *outboxamqp.Publisher {
	t.Helper()
	p, err := outboxamqp.NewPublisher(outboxamqp.Config{
		URL:          url,
		Exchange:     exchange,
		ReconnectMin: 20 * time.Millisecond,
		ReconnectMax: 200 * time.Millisecond,
		DialTimeout:  2 * time.Second,
		Logger:       log,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func relayConfig(t testing.TB) outbox.RelayConfig {
	return outbox.RelayConfig{
		BatchSize:       200,
		PollInterval:    50 * time.Millisecond,
		Lease:           20 * time.Second,
		PublishTimeout:  5 * time.Second,
		RetryBackoffMin: 10 * time.Millisecond,
		RetryBackoffMax: 100 * time.Millisecond,
		Logger:          testLogger(t, nil),
	}
}

func publishedIDs(t testing.TB, pool *pgxpool.Pool) []int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), "SELECT id FROM outbox_published ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// checkMarkedWereReceived fails the test if a row is marked published that the
// broker never delivered: a mark without a confirm.
func checkMarkedWereReceived(t testing.TB, pool *pgxpool.Pool, b *broker) {
	t.Helper()
	got := receivedIDs(b.deliveries())
	for _, id := range publishedIDs(t, pool) {
		if got[id] == 0 {
			t.Errorf("event %d is marked published but the queue never received it", id)
		}
	}
}

// testLogger logs to the test output under -v, and calls onMsg (if set) with
// every record's message.
func testLogger(t testing.TB, onMsg func(string)) *slog.Logger {
	return slog.New(&hookHandler{Handler: slog.NewTextHandler(outboxtest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelDebug}), onMsg: onMsg})
}

type hookHandler struct {
	slog.Handler
	onMsg func(string)
}

func (h *hookHandler) Handle(ctx context.Context, r slog.Record) error {
	if h.onMsg != nil {
		h.onMsg(r.Message)
	}
	return h.Handler.Handle(ctx, r)
}

func (h *hookHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &hookHandler{Handler: h.Handler.WithAttrs(as), onMsg: h.onMsg}
}

func (h *hookHandler) WithGroup(name string) slog.Handler {
	return &hookHandler{Handler: h.Handler.WithGroup(name), onMsg: h.onMsg}
}

// newProxy is a TCP forwarder in front of the test broker (see
// outboxtest.Proxy).
func newProxy(t testing.TB) *outboxtest.Proxy { return outboxtest.NewProxy(t, testAMQPURL()) }

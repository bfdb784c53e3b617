package outboxamqp_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest/amqptest"
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

// broker is a test's own exchange and queue on the test broker, deleted in
// cleanup, and a consumer that records every delivery (see
// amqptest.Broker).
type broker struct{ *amqptest.Broker }

// newBroker declares an exchange, and if bound, a durable queue bound to it
// with "#" that the test consumes in the background.
func newBroker(t testing.TB, bound bool) *broker {
	t.Helper()
	b := &broker{amqptest.NewBroker(t, testAMQPURL(), "outboxamqp-test-")}
	if bound {
		b.bind("#", nil)
	}
	return b
}

// bind declares the test's queue (with args on first declaration) and binds it
// with key; with no args, the test then consumes it in the background.
func (b *broker) bind(key string, args amqp.Table) {
	b.DeclareQueue(args)
	b.Bind(key)
	if args != nil {
		return // a queue with limits is inspected, not consumed
	}
	b.Consume()
}

var (
	receivedIDs  = amqptest.ReceivedIDs
	newPublisher = amqptest.NewPublisher
)

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
	got := receivedIDs(b.Deliveries())
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

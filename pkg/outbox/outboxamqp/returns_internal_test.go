package outboxamqp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// stuckHandler is a slog handler whose every record waits for stuck (a log
// sink that stopped taking writes) for longer than the client's 5s
// notification timeout.
type stuckHandler struct {
	stuck   time.Duration
	records *atomic.Int64
}

func (h stuckHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h stuckHandler) Handle(context.Context, slog.Record) error {
	h.records.Add(1)
	time.Sleep(h.stuck)
	return nil
}
func (h stuckHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h stuckHandler) WithGroup(string) slog.Handler      { return h }

// strayReturn publishes, on the channel p's next batch will take, a message
// that comes back as a return no batch awaits: the kind of return a reader
// would be tempted to log.
func strayReturn(t *testing.T, ctx context.Context, p *Publisher, exchange string) {
	t.Helper()
	s := p.conn.Load()
	c, err := s.acquire()
	if err != nil {
		t.Fatal(err)
	}
	defer s.release(c)
	if err := c.ch.PublishWithContext(ctx, exchange, "nowhere", true, false, amqp.Publishing{MessageId: "stray"}); err != nil {
		t.Fatal(err)
	}
}

// A logger that blocks must not cost a basic.return: the client waits 5s at
// most for its reader to take one and then drops it, and the message's ack
// that follows would make an unroutable message count as published. The
// batch is preceded by a return the publisher cannot match (a message it no
// longer awaits), which is the kind of return a reader would log. The returns
// buffer holds one message (MaxInFlight: 1), so a reader that waited for the
// logger even once would let the client drop the returns behind it: a large
// buffer would hide that.
func TestReturnsAreKeptWhileTheLoggerBlocks(t *testing.T) {
	t.Parallel()
	ch, exchange := returnsExchange(t)
	boundQueue(t, ch, exchange, "routed")

	var records atomic.Int64
	p, err := NewPublisher(Config{URL: outboxtest.AMQPURL(), Exchange: exchange, MaxInFlight: 1,
		Logger: slog.New(stuckHandler{stuck: 6 * time.Second, records: &records})})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}

	strayReturn(t, ctx, p, exchange)
	var msgs []outbox.Envelope
	for i := range 20 {
		key := "order.unroutable"
		if i%2 == 0 {
			key = "routed"
		}
		msgs = append(msgs, outbox.Envelope{ID: int64(i + 1), AggregateID: "o-" + strconv.Itoa(i), AggregateVersion: 1, EventType: key, Payload: []byte(`{}`)})
	}
	errs := p.PublishBatch(ctx, msgs)
	for i, err := range errs {
		switch {
		case i%2 == 0 && err != nil:
			t.Errorf("routed message %d: %v", msgs[i].ID, err)
		case i%2 == 1 && !errors.Is(err, outbox.ErrUnroutable):
			t.Errorf("unroutable message %d: %v, want ErrUnroutable (a nil here marks it published)", msgs[i].ID, err)
		}
	}
	if records.Load() == 0 {
		t.Fatal("the publisher logged nothing: the stuck logger was never in the way")
	}
}

// Returns the client put into the buffer before the acks a caller saw are all
// recorded when syncReturns returns, even those the reader had not taken yet.
func TestSyncReturnsRecordsWhatIsBuffered(t *testing.T) {
	t.Parallel()
	const n = 100
	c := &channel{returns: make(chan amqp.Return, n), syncReq: make(chan chan struct{}), drainDone: make(chan struct{})}
	var fs []*flight
	for i := range n {
		fs = append(fs, &flight{id: strconv.Itoa(i)})
	}
	c.track(fs)
	for _, f := range fs {
		c.returns <- amqp.Return{MessageId: f.id, ReplyCode: 312, ReplyText: "NO_ROUTE"}
	}
	go c.drainReturns()
	defer func() {
		close(c.returns)
		<-c.drainDone
	}()
	if err := c.syncReturns(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, f := range fs {
		if f.returned.Load() == nil {
			t.Fatalf("return of message %s still in the buffer after syncReturns", f.id)
		}
	}
}

// syncReturns gives up when its context ends, rather than wait for a reader
// that does not answer.
func TestSyncReturnsHonoursTheContext(t *testing.T) {
	t.Parallel()
	c := &channel{syncReq: make(chan chan struct{}), drainDone: make(chan struct{})} // no reader
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := c.syncReturns(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("syncReturns without a reader: %v, want the context's deadline", err)
	}
}

// The same through a relay: with the publisher's logger stuck, unroutable
// events are failed attempts, and none is marked published.
func TestRelayNeverMarksAReturnedEventWhileTheLoggerBlocks(t *testing.T) {
	t.Parallel()
	pool := outboxtest.Pool(t)
	_, exchange := returnsExchange(t)

	var records atomic.Int64
	p, err := NewPublisher(Config{URL: outboxtest.AMQPURL(), Exchange: exchange, MaxInFlight: 1,
		Logger: slog.New(stuckHandler{stuck: 6 * time.Second, records: &records})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() }) // after the relay has stopped: cleanups run last first
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	strayReturn(t, ctx, p, exchange)

	var msgs []outbox.Message
	for i := range 20 {
		msgs = append(msgs, outboxtest.Msg("o-"+strconv.Itoa(i), "order.created"))
	}
	events := outboxtest.Enqueue(t, pool, msgs...)
	done := make(chan outboxtest.BatchResult, 16)
	cfg := outbox.RelayConfig{
		BatchSize: 100, Workers: 1, PollInterval: time.Second, Lease: 40 * time.Second, PublishTimeout: 20 * time.Second,
		RetryBackoffMin: time.Minute, RetryBackoffMax: time.Minute,
		Logger:   slog.New(slog.DiscardHandler),
		Observer: outboxtest.OnBatch(nil, func(r outboxtest.BatchResult) { done <- r }),
	}
	outboxtest.StartRelay(t, pool, p, cfg)

	select {
	case r := <-done:
		if len(r.Published) != 0 || len(r.Failed) != len(events) {
			t.Fatalf("first batch: %d published, %d failed; want none published and all %d failed (returned)", len(r.Published), len(r.Failed), len(events))
		}
	case <-ctx.Done():
		t.Fatal("no batch done")
	}
	var marked int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published").Scan(&marked); err != nil {
		t.Fatal(err)
	}
	if marked != 0 {
		t.Fatalf("%d unroutable events marked published", marked)
	}
}

// returnsExchange declares a topic exchange of the test's own, deleted in
// cleanup, and returns it with the channel that declared it.
func returnsExchange(t *testing.T) (*amqp.Channel, string) {
	t.Helper()
	conn, err := amqp.Dial(outboxtest.AMQPURL())
	if err != nil {
		outboxtest.Unavailable(t, "RabbitMQ at "+outboxtest.AMQPURL(), err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	exchange := "outboxamqp-test-returns-" + hex.EncodeToString(b)
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(exchange, false, false) })
	return ch, exchange
}

// boundQueue declares a server-named, exclusive queue bound to exchange
// with key, and returns its name.
func boundQueue(t *testing.T, ch *amqp.Channel, exchange, key string) string {
	t.Helper()
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(q.Name, key, exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	return q.Name
}

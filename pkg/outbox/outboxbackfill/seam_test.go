package outboxbackfill_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxbackfill"
)

// queueRecorder records the message ids delivered to one queue.
type queueRecorder struct {
	mu  sync.Mutex
	ids map[string]int
}

func (q *queueRecorder) consume(t *testing.T, ch *amqp.Channel, queue string) {
	t.Helper()
	q.ids = map[string]int{}
	ds, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for d := range ds {
			q.mu.Lock()
			q.ids[d.MessageId]++
			q.mu.Unlock()
		}
	}()
}

func (q *queueRecorder) count(id string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.ids[id]
}

// An event the broker confirmed before the new queue was bound, whose move
// to the archive the writer of its aggregate's next event holds back past
// the backfill's start, must still reach the new queue.
func TestRunReplaysAnEventArchivedLate(t *testing.T) {
	t.Parallel()
	pool := outboxtest.Pool(t)
	ctx := context.Background()
	conn, err := amqp.Dial(outboxtest.AMQPURL())
	if err != nil {
		outboxtest.Unavailable(t, "RabbitMQ", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	exchange := "backfill-seam-" + hex.EncodeToString(b)
	oldQueue, newQueue := exchange+".old", exchange+".new"
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range []string{oldQueue, newQueue} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = ch.ExchangeDelete(exchange, false, false)
	})
	bind := func(q string, r *queueRecorder) {
		if _, err := ch.QueueDeclare(q, false, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(q, "#", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
		r.consume(t, ch, q)
	}
	var oldQ, newQ queueRecorder
	bind(oldQueue, &oldQ)

	// Version 1 is committed; the writer of version 2 holds it (FOR KEY
	// SHARE, as Enqueue does) while the relay publishes it.
	first := outboxtest.Enqueue(t, pool, outboxtest.Msg("o-1", "order.created"))[0]
	firstID := outbox.MessageID(first.ID, first.CreatedAt)
	writer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = writer.Rollback(ctx) }()
	second, err := new(outbox.Writer).Enqueue(ctx, writer, outboxtest.Msg("o-1", "order.paid"))
	if err != nil {
		t.Fatal(err)
	}
	secondID := outbox.MessageID(second[0].ID, second[0].CreatedAt)

	live, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: outboxtest.AMQPURL(), Exchange: exchange, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = live.Close() })
	outboxtest.StartRelay(t, pool, live, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, Lease: 2 * time.Minute, Logger: outboxtest.Logger(t)})
	outboxtest.WaitFor(t, "the old queue to get version 1", 60*time.Second, func() (bool, error) { return oldQ.count(firstID) == 1, nil })

	// The new service binds its queue; the backfill starts.
	bind(newQueue, &newQ)
	target, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: outboxtest.AMQPURL(), Queue: newQueue, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = target.Close() })
	bf, err := outboxbackfill.New(pool, target, outboxbackfill.Config{Name: newQueue, Logger: outboxtest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- bf.Run(ctx) }()
	// The backfill waits for version 1 to leave the outbox (version 2 is not
	// committed: the wait does not see it).
	outboxtest.WaitFor(t, "the backfill to wait for version 1", 60*time.Second, func() (bool, error) {
		select {
		case err := <-done:
			return false, fmt.Errorf("the backfill ended (%v) with version 1 in the outbox", err)
		default:
		}
		p := bf.Progress()
		return p.Waiting == 1 && p.OldestWaiting == first.ID && p.Total == -1, nil
	})
	if err := writer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the backfill did not finish")
	}
	if p := bf.Progress(); !p.Finished || p.Waiting != 0 || p.Total < 1 || p.Replayed != p.Total {
		t.Fatalf("progress %+v, want finished with version 1 at least", p)
	}
	outboxtest.WaitFor(t, "the relay to publish version 2", 60*time.Second, outboxtest.OutboxEmpty(pool))
	outboxtest.WaitFor(t, "version 2 on the new queue", 60*time.Second, func() (bool, error) { return newQ.count(secondID) > 0, nil })
	time.Sleep(time.Second) // let a late copy arrive
	if n := newQ.count(firstID); n == 0 {
		t.Fatalf("the new queue never got version 1 (confirmed before its binding, archived after the backfill started)")
	}
	if n := oldQ.count(firstID); n != 1 {
		t.Fatalf("the old queue got version 1 %d times, want once", n)
	}
}

// Dead letters, and the events behind them, wait for an operator: the
// backfill does not wait for them (they are published after the binding if
// ever), and replays the rest.
func TestRunDoesNotWaitForDeadLetters(t *testing.T) {
	t.Parallel()
	pool := outboxtest.EveryState(t) // 1..5 published, 6 dead-lettered, 7 discarded, 8 behind 6
	target := outboxtest.NewRecorder()
	bf, err := outboxbackfill.New(pool, target, outboxbackfill.Config{Name: "dead", Logger: outboxtest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := bf.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if p := bf.Progress(); !p.Finished || p.Total != 5 || target.Distinct() != 5 {
		t.Fatalf("progress %+v, %d events sent; want the five published ones", p, target.Distinct())
	}
}

package outboxamqp_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// overlapping is the real publisher, with a batch holding an event of
// aggregate agg held back until another batch has begun publishing, so that
// the nack it gets comes while the other batch is in flight.
type overlapping struct {
	outbox.Publisher
	agg    string
	others chan struct{}
}

func (p *overlapping) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	if slices.ContainsFunc(msgs, func(e outbox.Envelope) bool { return e.AggregateID == p.agg }) {
		select {
		case <-p.others:
		case <-time.After(time.Second): // no other traffic: go alone
		}
	} else {
		select {
		case p.others <- struct{}{}:
		default:
		}
	}
	return p.Publisher.PublishBatch(ctx, msgs)
}

// A nack fails the batch that got it, never another worker's batch in
// flight at the same time: one aggregate's events go to a queue that holds
// one message and makes the broker nack every publish after it
// (x-max-length=1, x-overflow=reject-publish), so its head fails and is
// retried again and again, while the events of other aggregates, written
// steadily, go to an ordinary queue through the same relay and publisher.
// Every one of them is confirmed at its first attempt.
func TestANackFailsOnlyItsOwnBatch(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	b := newBroker(t, false)
	full := b.Queue + ".full"
	if _, err := b.Ch.QueueDeclare(full, false, false, false, false, amqp.Table{"x-max-length": int64(1), "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = b.Ch.QueueDelete(full, false, false, false) })
	if err := b.Ch.QueueBind(full, "order.rejected", b.Exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	// The others' queue is a quorum queue, as shipping's is: its confirms
	// take a few milliseconds, so their batches are in flight for a while.
	if _, err := b.Ch.QueueDeclare(b.Queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	if err := b.Ch.QueueBind(b.Queue, "order.created", b.Exchange, false, nil); err != nil {
		t.Fatal(err)
	}

	var (
		nacks    atomic.Int64
		rejected atomic.Int64 // the id of the event the broker keeps nacking
	)
	cfg := relayConfig(t)
	cfg.Workers = 2
	cfg.BatchSize = 200
	cfg.PollInterval = 10 * time.Millisecond
	cfg.MaxAttempts = 1_000_000 // this test is about the other batches, not dead letters
	cfg.RetryBackoffMin, cfg.RetryBackoffMax = time.Millisecond, 5*time.Millisecond
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		// BatchDone runs on the workers: keep it cheap.
		if slices.Contains(r.Failed, rejected.Load()) {
			nacks.Add(1)
		}
	})
	pub := &overlapping{Publisher: newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil)), agg: "rejected", others: make(chan struct{}, 1)}
	relay := startRelay(t, pool, pub, cfg)

	// The rejected aggregate: its first event fills the queue, the second
	// is nacked at every attempt.
	ids := enqueue(t, pool, msg("rejected", "order.rejected"), msg("rejected", "order.rejected"))
	rejected.Store(ids[1].ID)

	// Steady traffic of other aggregates, in small transactions, while the
	// rejected one is nacked again and again.
	const writers, rounds, perRound = 2, 40, 100
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		written []outbox.Enqueued
	)
	for w := range writers {
		wg.Go(func() {
			for i := range rounds {
				var batch []outbox.Message
				for j := range perRound {
					batch = append(batch, msg(fmt.Sprintf("w%d-%d-%d", w, i, j), "order.created"))
				}
				es := enqueue(t, pool, batch...)
				relay.Wake()
				mu.Lock()
				written = append(written, es...)
				mu.Unlock()
				time.Sleep(5 * time.Millisecond) // a steady rate, not a backlog
			}
		})
	}
	wg.Wait()
	waitFor(t, "every event of the other aggregates marked", 90*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE aggregate_id <> 'rejected'").Scan(&n)
		return n == 0, err
	})
	var firstTime, retried int
	err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE attempts = 1), count(*) FILTER (WHERE attempts > 1)
		FROM outbox_published WHERE aggregate_id <> 'rejected'`).Scan(&firstTime, &retried)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d events of other aggregates confirmed at their first attempt, %d needed more; %d nacks of the rejected one",
		firstTime, retried, nacks.Load())
	if nacks.Load() < 3 {
		t.Fatalf("the rejected aggregate was nacked %d times while the others were written: too few to tell", nacks.Load())
	}
	if retried != 0 {
		t.Fatalf("%d events of other aggregates needed a second attempt: a nack failed batches besides its own", retried)
	}
}

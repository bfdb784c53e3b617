// Package amqptest holds the RabbitMQ helpers the tests of outboxamqp and
// outboxwal share: an exchange and a queue of the test's own with a consumer
// that records every delivery, and a publisher that reconnects quickly. It
// is apart from outboxtest so that pkg/outbox's own tests import no broker
// client.
package amqptest

import (
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// Broker is a test's own exchange and queue (Exchange + ".q") on the test
// broker, both deleted in cleanup, and a consumer that records every
// delivery.
type Broker struct {
	t        testing.TB
	Ch       *amqp.Channel
	Exchange string
	Queue    string

	mu       sync.Mutex
	received []amqp.Delivery
	changed  chan struct{} // closed and replaced on every delivery
}

// NewBroker declares a topic exchange named prefix and random hex on the
// broker at url; the queue is declared by DeclareQueue. It skips the test
// (fails it under CI=true) when the broker is unreachable.
func NewBroker(t testing.TB, url, prefix string) *Broker {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		outboxtest.Unavailable(t, "RabbitMQ at "+url, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	b := &Broker{t: t, Ch: ch, Exchange: prefix + randomHex(6), changed: make(chan struct{})}
	b.Queue = b.Exchange + ".q"
	if err := ch.ExchangeDeclare(b.Exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := ch.QueueDelete(b.Queue, false, false, false); err != nil {
			t.Errorf("delete queue: %v", err)
		}
		if err := ch.ExchangeDelete(b.Exchange, false, false); err != nil {
			t.Errorf("delete exchange: %v", err)
		}
		_ = conn.Close()
	})
	return b
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// DeclareQueue declares the test's durable queue, with args.
func (b *Broker) DeclareQueue(args amqp.Table) {
	b.t.Helper()
	if _, err := b.Ch.QueueDeclare(b.Queue, true, false, false, false, args); err != nil {
		b.t.Fatal(err)
	}
}

// Bind binds the test's queue to its exchange with key.
func (b *Broker) Bind(key string) {
	b.t.Helper()
	if err := b.Ch.QueueBind(b.Queue, key, b.Exchange, false, nil); err != nil {
		b.t.Fatal(err)
	}
}

// Consume consumes the test's queue in the background, recording every
// delivery.
func (b *Broker) Consume() {
	b.t.Helper()
	deliveries, err := b.Ch.Consume(b.Queue, "", true, false, false, false, nil)
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

// Deliveries returns the deliveries so far.
func (b *Broker) Deliveries() []amqp.Delivery {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.received)
}

// WaitDeliveries waits until cond holds on the deliveries so far, and fails
// the test after timeout.
func (b *Broker) WaitDeliveries(what string, timeout time.Duration, cond func([]amqp.Delivery) bool) []amqp.Delivery {
	b.t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		b.mu.Lock()
		got, changed := slices.Clone(b.received), b.changed
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

// ReceivedIDs counts deliveries per message id.
func ReceivedIDs(ds []amqp.Delivery) map[int64]int {
	out := map[int64]int{}
	for _, d := range ds {
		id, _, _ := outbox.ParseMessageID(d.MessageId)
		out[id]++
	}
	return out
}

// NewPublisher returns a publisher to exchange on the broker at url that
// reconnects quickly, closed when the test ends.
func NewPublisher(t testing.TB, url, exchange string, log *slog.Logger) *outboxamqp.Publisher {
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

package outboxamqp_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox/publishertest"
)

// The Publisher passes the publisher conformance kit against the test
// broker: each check on an exchange of its own, publishing through a proxy.
// The kit's stored messages go to a durable queue, the refused ones to a
// queue that holds none (x-max-length 0, reject-publish: a nack), and the
// unroutable ones nowhere (a basic.return). RabbitMQ does not deduplicate.
func TestPublisherConformance(t *testing.T) {
	publishertest.Run(t, publishertest.Harness{
		New:          newConformanceTarget,
		Unroutable:   true,
		Refuses:      true,
		Deduplicates: false,
	})
}

func newConformanceTarget(t *testing.T) publishertest.Target {
	b := newBroker(t, false)
	refusing := b.Queue + ".refusing"
	for _, q := range []struct {
		name, key string
		args      amqp.Table
	}{
		{b.Queue, publishertest.EventStored, nil},
		{refusing, publishertest.EventRefused, amqp.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"}},
	} {
		if _, err := b.Ch.QueueDeclare(q.name, true, false, false, false, q.args); err != nil {
			t.Fatal(err)
		}
		if err := b.Ch.QueueBind(q.name, q.key, b.Exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		if _, err := b.Ch.QueueDelete(refusing, false, false, false); err != nil {
			t.Errorf("delete queue: %v", err)
		}
	})
	px := newProxy(t)
	p := newPublisher(t, px.URL(t), b.Exchange, testLogger(t, nil))
	s := &storedReader{ch: b.Ch, queue: b.Queue}
	return publishertest.Target{Publisher: p, Close: p.Close, Stored: s.read, Link: px}
}

// storedReader takes what the queue holds with basic.get, and returns it
// with what it took before.
type storedReader struct {
	mu    sync.Mutex
	ch    *amqp.Channel
	queue string
	got   []publishertest.Message
}

func (s *storedReader) read(context.Context) ([]publishertest.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		d, ok, err := s.ch.Get(s.queue, true)
		if err != nil {
			return nil, fmt.Errorf("basic.get: %w", err)
		}
		if !ok {
			return append([]publishertest.Message(nil), s.got...), nil
		}
		h := make(map[string]string, len(d.Headers))
		for k, v := range d.Headers {
			h[k] = fmt.Sprint(v)
		}
		s.got = append(s.got, publishertest.Message{ID: d.MessageId, Headers: h, Body: d.Body})
	}
}

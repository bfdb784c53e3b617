package outboxamqp_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// With Config.Queue, messages go to that queue alone, through the default
// exchange, in the envelope the live relay uses: a queue bound to the
// exchange gets none of them, and a queue that does not exist makes each
// message fail as unroutable.
func TestQueueSendsToThatQueueAlone(t *testing.T) {
	t.Parallel()
	for _, cfg := range []outboxamqp.Config{
		{URL: testAMQPURL(), Queue: "q", Exchange: "x"},
		{URL: testAMQPURL(), Queue: "q", ExchangeType: "fanout"},
		{URL: testAMQPURL(), Queue: "q", RoutingKey: func(outbox.Envelope) string { return "k" }},
		{URL: testAMQPURL()},
	} {
		if _, err := outboxamqp.NewPublisher(cfg); err == nil {
			t.Errorf("NewPublisher accepted Queue %q, Exchange %q, ExchangeType %q, RoutingKey set %v",
				cfg.Queue, cfg.Exchange, cfg.ExchangeType, cfg.RoutingKey != nil)
		}
	}

	target := newBroker(t, true) // the new consumer's queue
	other := newBroker(t, true)  // a consumer bound to the live exchange
	if err := other.Ch.QueueBind(other.Queue, "#", target.Exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: testAMQPURL(), Queue: target.Queue, Logger: testLogger(t, nil)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := pub.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	envs := make([]outbox.Envelope, 3)
	for i := range envs {
		envs[i] = outbox.Envelope{ID: int64(i + 1), AggregateType: "order", AggregateID: "o-1", AggregateVersion: int64(i + 1),
			EventType: "order.changed", Payload: []byte(`{}`), Headers: map[string]string{"traceparent": "t"}, CreatedAt: time.Now(), Attempt: 1}
	}
	for i, err := range pub.PublishBatch(ctx, envs) {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	got := target.WaitDeliveries("the replayed messages", 30*time.Second, func(ds []amqp.Delivery) bool { return len(ds) >= len(envs) })
	for i, d := range got {
		want := outboxamqp.Publishing(envs[i])
		if d.Exchange != "" || d.RoutingKey != target.Queue || d.MessageId != want.MessageId || d.Headers["aggregate_version"] != envs[i].AggregateVersion {
			t.Errorf("delivery %d: exchange %q, key %q, id %s, headers %v; want the default exchange, key %q, id %s",
				i, d.Exchange, d.RoutingKey, d.MessageId, d.Headers, target.Queue, want.MessageId)
		}
	}
	time.Sleep(500 * time.Millisecond)
	if n := len(other.Deliveries()); n != 0 {
		t.Fatalf("a queue bound to the exchange got %d of the messages sent to one queue", n)
	}

	missing, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: testAMQPURL(), Queue: randomName("no-such-queue-"), Logger: testLogger(t, nil)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = missing.Close() })
	if err := missing.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	for i, err := range missing.PublishBatch(ctx, envs[:1]) {
		if !errors.Is(err, outbox.ErrUnroutable) {
			t.Fatalf("message %d to a missing queue: %v, want ErrUnroutable", i, err)
		}
	}
}

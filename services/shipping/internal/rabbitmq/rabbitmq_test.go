package rabbitmq

import (
	"context"
	"errors"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestNewValidatesConfig(t *testing.T) {
	ok := HandlerFunc(func(context.Context, shipment.Delivery) shipment.Verdict {
		return shipment.Verdict{Action: shipment.Ack}
	})
	for name, tc := range map[string]struct {
		cfg Config
		h   Handler
	}{
		"no url":            {Config{}, ok},
		"bad url":           {Config{URL: "http://x"}, ok},
		"nil handler":       {Config{URL: "amqp://localhost/"}, nil},
		"negative prefetch": {Config{URL: "amqp://localhost/", Prefetch: -1}, ok},
		"huge prefetch":     {Config{URL: "amqp://localhost/", Prefetch: 70000}, ok},
		"retry min > max":   {Config{URL: "amqp://localhost/", RetryMin: time.Second, RetryMax: time.Millisecond}, ok},
		"same queue twice":  {Config{URL: "amqp://localhost/", Topology: Topology{Queue: "q", DelayQueue: "q"}}, ok},
		"same exchanges":    {Config{URL: "amqp://localhost/", Topology: Topology{Exchange: "x", DeadLetterExchange: "x"}}, ok},
		"tiny delay":        {Config{URL: "amqp://localhost/", Topology: Topology{Delay: time.Microsecond}}, ok},
		"negative limit":    {Config{URL: "amqp://localhost/", Topology: Topology{DeliveryLimit: -1}}, ok},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := New(tc.cfg, tc.h); err == nil {
				t.Fatalf("New(%+v) succeeded", tc.cfg)
			}
		})
	}
	c, err := New(Config{URL: "amqp://localhost/"}, ok)
	if err != nil {
		t.Fatal(err)
	}
	top := c.Topology()
	want := Topology{
		Exchange: "orders.events", Queue: "shipping.order-events", BindingKey: "order.*",
		DeadLetterExchange: "shipping.dlx", DeadLetterQueue: "shipping.order-events.dlq",
		DelayQueue: "shipping.order-events.delay", Delay: time.Second, DeliveryLimit: 20,
	}
	if top != want {
		t.Fatalf("default topology %+v, want %+v", top, want)
	}
}

func channel(t *testing.T, url string) (*amqp.Connection, *amqp.Channel) {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	return conn, ch
}

func TestDeclareIsIdempotentAndTheDelayQueueLeadsBack(t *testing.T) {
	t.Parallel()
	_, url := amqptest.VHost(t)
	conn, ch := channel(t, url)
	top := Topology{Delay: 50 * time.Millisecond}.WithDefaults()
	for i := range 2 {
		if err := top.Declare(ch); err != nil {
			t.Fatalf("declare #%d: %v", i+1, err)
		}
	}

	pub, err := newPublisher(conn, 8)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.close()
	if err := pub.publish(t.Context(), "", top.DelayQueue, amqp.Publishing{MessageId: "d-1", Body: []byte("x")}); err != nil {
		t.Fatalf("publish to the delay queue: %v", err)
	}
	// The deferred message comes back to the main queue.
	if d := amqptest.GetOne(t, ch, top.Queue); d.MessageId != "d-1" {
		t.Fatalf("got %q", d.MessageId)
	}
}

func TestPublisherReportsUnroutableMessages(t *testing.T) {
	t.Parallel()
	_, url := amqptest.VHost(t)
	conn, ch := channel(t, url)
	if _, err := ch.QueueDeclare("there", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	pub, err := newPublisher(conn, 8)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.close()
	for range 3 {
		if err := pub.publish(t.Context(), "", "nowhere", amqp.Publishing{Body: []byte("x")}); !errors.Is(err, ErrReturned) {
			t.Fatalf("publish to a missing queue: %v, want ErrReturned", err)
		}
		if err := pub.publish(t.Context(), "", "there", amqp.Publishing{Body: []byte("x")}); err != nil {
			t.Fatalf("publish to an existing queue: %v", err)
		}
	}
}

func TestShutdownLetsInFlightDeliveriesFinish(t *testing.T) {
	t.Parallel()
	vhost, url := amqptest.VHost(t)
	entered, release := make(chan struct{}), make(chan struct{})
	c, err := New(Config{URL: url, Concurrency: 1, Prefetch: 5}, HandlerFunc(func(ctx context.Context, d shipment.Delivery) shipment.Verdict {
		if d.MessageID == "slow" {
			close(entered)
			<-release
		}
		return shipment.Verdict{Action: shipment.Ack}
	}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for c.Ready() != nil {
		if time.Now().After(deadline) {
			t.Fatal("consumer not ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, ch := channel(t, url)
	for _, id := range []string{"slow", "next-1", "next-2"} {
		if err := ch.PublishWithContext(t.Context(), "orders.events", "order.created", false, false, amqp.Publishing{MessageId: id}); err != nil {
			t.Fatal(err)
		}
	}
	<-entered
	cancel() // SIGTERM while "slow" is in flight
	time.AfterFunc(100*time.Millisecond, func() { close(release) })
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	// "slow" was acked (not redelivered); the two prefetched but not started
	// go back to the queue (the broker returns them asynchronously after the
	// close).
	deadline = time.Now().Add(30 * time.Second)
	for {
		ready, unacked := amqptest.QueueCounts(t, vhost, c.Topology().Queue)
		if ready == 2 && unacked == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after shutdown: %d ready, %d unacked; want 2 and 0", ready, unacked)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The broker requeues them in no promised order: check the set.
	_, ch2 := channel(t, url)
	got := map[string]bool{}
	for range 2 {
		d, ok, err := ch2.Get(c.Topology().Queue, true)
		if err != nil || !ok {
			t.Fatalf("queue get: %v %v", ok, err)
		}
		got[d.MessageId] = true
	}
	if !got["next-1"] || !got["next-2"] {
		t.Fatalf("requeued %v, want next-1 and next-2", got)
	}
}

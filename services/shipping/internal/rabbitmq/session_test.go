package rabbitmq

import (
	"context"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
)

// startConsumer runs a consumer until the test ends and waits until it
// consumes. Its logs go to the test's output.
func startConsumer(t *testing.T, cfg Config, h Handler) *Consumer {
	t.Helper()
	cfg.Logger = slog.New(slog.NewTextHandler(t.Output(), nil))
	c, err := New(cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Errorf("Run did not return 60s after cancel")
		}
	})
	waitUntil(t, 60*time.Second, "consumer ready", func() bool { return c.Ready() == nil })
	return c
}

func waitUntil(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// await reads ids until want comes, or fails after limit.
func await(t *testing.T, ids <-chan string, want string, limit time.Duration) {
	t.Helper()
	timer := time.NewTimer(limit)
	defer timer.Stop()
	for {
		select {
		case id := <-ids:
			if id == want {
				return
			}
		case <-timer.C:
			t.Fatalf("message %q not handled within %v", want, limit)
		}
	}
}

func publishEvent(t *testing.T, ch *amqp.Channel, id string) {
	t.Helper()
	if err := ch.PublishWithContext(t.Context(), "orders.events", "order.created", false, false,
		amqp.Publishing{MessageId: id, DeliveryMode: amqp.Persistent, Body: []byte("{}")}); err != nil {
		t.Fatalf("publish %s: %v", id, err)
	}
}

// A queue deleted under the consumer (or any broker-side basic.cancel)
// closes its deliveries channel: the consumer must report itself not ready,
// reconnect, redeclare the queue and consume again.
func TestConsumerRedeclaresItsQueueAfterTheBrokerCancelsIt(t *testing.T) {
	t.Parallel()
	vhost, url := amqptest.VHost(t)
	ids := make(chan string, 16)
	m, err := metrics.New(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	c := startConsumer(t, Config{URL: url, Metrics: m}, HandlerFunc(func(_ context.Context, d shipment.Delivery) shipment.Verdict {
		ids <- d.MessageID
		return shipment.Verdict{Action: shipment.Ack}
	}))
	_, ch := channel(t, url)
	publishEvent(t, ch, "before")
	await(t, ids, "before", 60*time.Second)

	// With the user's access revoked the consumer cannot come back, so its
	// not-ready state can be observed without racing the reconnection.
	amqptest.RevokeAccess(t, vhost)
	amqptest.DeleteQueue(t, vhost, c.Topology().Queue)
	waitUntil(t, 60*time.Second, "Ready to fail once the queue is deleted", func() bool { return c.Ready() != nil })
	amqptest.RestoreAccess(t, vhost)
	waitUntil(t, 60*time.Second, "the consumer to consume again", func() bool { return c.Ready() == nil })
	if _, _, ok := amqptest.TryQueueCounts(t, vhost, c.Topology().Queue); !ok {
		t.Fatalf("queue %s not redeclared", c.Topology().Queue)
	}
	publishEvent(t, ch, "after")
	await(t, ids, "after", 60*time.Second)
}

// A deferred or dead-lettered copy that cannot be routed (its queue or the
// dead-letter exchange was deleted) ends the session, so the reconnection
// redeclares the topology and the copy is published again.
func TestMissingRepublishTargetRedeclaresTheTopology(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		action shipment.Action
		remove func(t *testing.T, vhost, url string, top Topology)
	}{
		{"delay queue deleted", shipment.Defer, func(t *testing.T, vhost, _ string, top Topology) {
			amqptest.DeleteQueue(t, vhost, top.DelayQueue) // the copy is returned
		}},
		{"dead-letter queue deleted", shipment.DeadLetter, func(t *testing.T, vhost, _ string, top Topology) {
			amqptest.DeleteQueue(t, vhost, top.DeadLetterQueue) // the copy is returned
		}},
		{"dead-letter exchange deleted", shipment.DeadLetter, func(t *testing.T, _, url string, top Topology) {
			// The publish closes the publishing channel (404 NOT_FOUND).
			_, ch := channel(t, url)
			if err := ch.ExchangeDelete(top.DeadLetterExchange, false, false); err != nil {
				t.Fatalf("delete exchange %s: %v", top.DeadLetterExchange, err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			vhost, url := amqptest.VHost(t)
			back := make(chan string, 16)
			c := startConsumer(t, Config{URL: url, Topology: Topology{Delay: 50 * time.Millisecond}},
				HandlerFunc(func(_ context.Context, d shipment.Delivery) shipment.Verdict {
					if _, ok := d.Headers[shipment.HeaderOriginalRoutingKey]; ok {
						back <- d.MessageID // came back through the delay queue
						return shipment.Verdict{Action: shipment.Ack}
					}
					return shipment.Verdict{Action: tc.action, Reason: "test"}
				}))
			top := c.Topology()
			tc.remove(t, vhost, url, top)
			_, ch := channel(t, url)
			publishEvent(t, ch, "m")

			if tc.action == shipment.Defer {
				await(t, back, "m", 60*time.Second)
			} else {
				waitUntil(t, 60*time.Second, "the dead letter in "+top.DeadLetterQueue, func() bool {
					ready, _, ok := amqptest.TryQueueCounts(t, vhost, top.DeadLetterQueue)
					return ok && ready == 1
				})
			}
			waitUntil(t, 60*time.Second, "the main queue drained", func() bool {
				ready, unacked := amqptest.QueueCounts(t, vhost, top.Queue)
				return ready+unacked == 0
			})
		})
	}
}

// Deferred and dead-lettered copies are published on a connection of their
// own: a publishing connection blocked by a resource alarm (or closed) must
// not hold up the consumer's acks.
func TestRepublishingHasItsOwnConnection(t *testing.T) {
	t.Parallel()
	vhost, url := amqptest.VHost(t)
	var mu sync.Mutex
	var holds []bool // Redelivered flag of each "hold" delivery
	entered, release := make(chan struct{}, 4), make(chan struct{})
	back := make(chan string, 16)
	c := startConsumer(t, Config{URL: url, Concurrency: 2, ConnectionName: "shipping-test", Topology: Topology{Delay: 50 * time.Millisecond}},
		HandlerFunc(func(_ context.Context, d shipment.Delivery) shipment.Verdict {
			switch {
			case d.MessageID == "hold":
				mu.Lock()
				holds = append(holds, d.Redelivered)
				mu.Unlock()
				entered <- struct{}{}
				<-release
				return shipment.Verdict{Action: shipment.Ack}
			case d.Headers[shipment.HeaderOriginalRoutingKey] != nil:
				back <- d.MessageID
				return shipment.Verdict{Action: shipment.Ack}
			default:
				return shipment.Verdict{Action: shipment.Defer, Reason: "test"}
			}
		}))
	_, ch := channel(t, url)
	publishEvent(t, ch, "defer-1")
	await(t, back, "defer-1", 60*time.Second)

	byName := func() map[string]string {
		out := map[string]string{}
		for _, conn := range amqptest.Connections(t, vhost) {
			out[conn.Name] = conn.PID
		}
		return out
	}
	conns := byName()
	consumerPID, publisherPID := conns["shipping-test"], conns["shipping-test-publisher"]
	if consumerPID == "" || publisherPID == "" {
		t.Fatalf("connections by name %v: want the consumer's (shipping-test) and a publishing one (shipping-test-publisher)", conns)
	}

	// Close the publishing connection while a delivery is in flight: the
	// delivery is still acked on the consuming connection, never redelivered.
	publishEvent(t, ch, "hold")
	<-entered
	amqptest.CloseConnection(t, publisherPID, "amqptest: publishing connection closed")
	close(release)
	waitUntil(t, 60*time.Second, "the main queue drained", func() bool {
		ready, unacked := amqptest.QueueCounts(t, vhost, c.Topology().Queue)
		return ready+unacked == 0
	})
	mu.Lock()
	if !slices.Equal(holds, []bool{false}) {
		t.Errorf("hold delivered %d times (redelivered flags %v), want once", len(holds), holds)
	}
	mu.Unlock()

	// The publisher reconnects on its own; the consumer kept its connection.
	publishEvent(t, ch, "defer-2")
	await(t, back, "defer-2", 60*time.Second)
	conns = byName()
	if conns["shipping-test"] != consumerPID {
		t.Errorf("consumer connection %q, want the same %q throughout", conns["shipping-test"], consumerPID)
	}
	if p := conns["shipping-test-publisher"]; p == "" || p == publisherPID {
		t.Errorf("publishing connection %q after closing %q: want a new one", p, publisherPID)
	}
}

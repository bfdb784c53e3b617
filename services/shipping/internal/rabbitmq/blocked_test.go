package rabbitmq

import (
	"context"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/internal/rabbitnode"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
)

// queueDepth is the messages in queue on n, ready or unacked.
func queueDepth(t *testing.T, n *rabbitnode.Running, queue string) int {
	t.Helper()
	out, err := n.Ctl(t.Context(), "list_queues", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(out, "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == queue {
			ready, _ := strconv.Atoi(f[1])
			unacked, _ := strconv.Atoi(f[2])
			return ready + unacked
		}
	}
	t.Fatalf("queue %s not listed: %q", queue, out)
	return 0
}

// A broker that blocks the publishing connection (a memory alarm, here on a
// node of the test's own) must not freeze the consumer: a deferral waits for
// its confirm at most ConfirmTimeout, then its delivery goes back to the
// queue and the worker moves on, so the deliveries that need only an ack are
// acked while the alarm lasts. Once it clears, the deferred messages go
// round the delay queue and come back.
func TestBlockedPublishingConnectionDoesNotFreezeTheAcks(t *testing.T) {
	t.Parallel()
	// A node of the test's own: a resource alarm on the machine's broker
	// would block every other test's publishers.
	node := rabbitnode.ForTest(t, "shipping-blocked")
	m, err := metrics.New(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	top := Topology{Delay: 50 * time.Millisecond}.WithDefaults()
	_, ch := channel(t, node.URL())
	if err := top.Declare(ch); err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	// Two to defer first, one per worker, then six that only need an ack.
	deferred := []string{"d-1", "d-2"}
	acked := []string{"a-1", "a-2", "a-3", "a-4", "a-5", "a-6"}
	for _, id := range append(append([]string{}, deferred...), acked...) {
		dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), top.Exchange, "order.created", false, false,
			amqp.Publishing{MessageId: id, DeliveryMode: amqp.Persistent, Body: []byte("{}")})
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := dc.WaitContext(t.Context()); err != nil || !ok {
			t.Fatalf("publish %s: confirmed %v, %v", id, ok, err)
		}
	}
	// Every connection that publishes is blocked from now on.
	if _, err := node.Ctl(t.Context(), "set_vm_memory_high_watermark", "0"); err != nil {
		t.Fatal(err)
	}
	alarm := true
	t.Cleanup(func() {
		if alarm {
			_, _ = node.Ctl(context.WithoutCancel(t.Context()), "set_vm_memory_high_watermark", "0.4")
		}
	})

	var mu sync.Mutex
	handled := map[string]int{}
	back := make(chan string, 16)
	startConsumer(t, Config{URL: node.URL(), Concurrency: 2, Prefetch: 16, ConfirmTimeout: 2 * time.Second, Topology: top, Metrics: m},
		HandlerFunc(func(_ context.Context, d shipment.Delivery) shipment.Verdict {
			if d.Headers[shipment.HeaderOriginalRoutingKey] != nil {
				back <- d.MessageID // round the delay queue
				return shipment.Verdict{Action: shipment.Ack}
			}
			mu.Lock()
			handled[d.MessageID]++
			mu.Unlock()
			if strings.HasPrefix(d.MessageID, "d-") {
				return shipment.Verdict{Action: shipment.Defer, Reason: "test"}
			}
			return shipment.Verdict{Action: shipment.Ack}
		}))

	blocked := false
	waitUntil(t, 60*time.Second, "every ack-only delivery handled while the alarm lasts", func() bool {
		blocked = blocked || gauge(m.PublisherBlocked) == 1
		mu.Lock()
		defer mu.Unlock()
		for _, id := range acked {
			if handled[id] == 0 {
				return false
			}
		}
		return true
	})
	// Acked, not just handled: only the deferred ones are left in the queue.
	waitUntil(t, 60*time.Second, "the queue down to the two deferred messages", func() bool {
		blocked = blocked || gauge(m.PublisherBlocked) == 1
		return queueDepth(t, node, top.Queue) == len(deferred)
	})
	if !blocked {
		t.Error("the publishing connection was never reported blocked: the alarm did not block it")
	}
	if n := counter(m.RepublishTimeouts); n == 0 {
		t.Error("no republish timed out: the deferrals were not held up by the alarm")
	}
	mu.Lock()
	for _, id := range acked {
		if handled[id] != 1 {
			t.Errorf("%s handled %d times, want once", id, handled[id])
		}
	}
	mu.Unlock()

	if _, err := node.Ctl(t.Context(), "set_vm_memory_high_watermark", "0.4"); err != nil {
		t.Fatal(err)
	}
	alarm = false
	for _, id := range deferred {
		await(t, back, id, 60*time.Second)
	}
	waitUntil(t, 60*time.Second, "the queues drained", func() bool {
		return queueDepth(t, node, top.Queue)+queueDepth(t, node, top.DelayQueue) == 0
	})
}

func gauge(g prometheus.Gauge) float64 {
	var m dto.Metric
	_ = g.Write(&m)
	return m.GetGauge().GetValue()
}

func counter(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

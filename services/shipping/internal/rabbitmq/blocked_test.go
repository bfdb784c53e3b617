package rabbitmq

import (
	"context"
	"log/slog"
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
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// queueDepth is the messages in queue on n, ready or unacked.
func queueDepth(t *testing.T, n *rabbitnode.Running, queue string) int {
	t.Helper()
	ready, unacked := queueCounts(t, n, queue)
	return ready + unacked
}

// queueCounts is the messages in queue on n: ready, and delivered but not
// acked.
func queueCounts(t *testing.T, n *rabbitnode.Running, queue string) (ready, unacked int) {
	t.Helper()
	out, err := n.Ctl(t.Context(), "list_queues", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(out, "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == queue {
			ready, _ = strconv.Atoi(f[1])
			unacked, _ = strconv.Atoi(f[2])
			return ready, unacked
		}
	}
	t.Fatalf("queue %s not listed: %q", queue, out)
	return 0, 0
}

// A broker that blocks the publishing connection (a memory alarm, here on a
// node of the test's own) must not freeze the consumer: a delivery whose
// copy cannot be published waits, unacked, off the worker, while the
// deliveries that need only an ack are acked. Two workers and a confirm
// timeout longer than the test: two deferrals that held their workers
// would stop everything. d-1 is deferred first, its copy the publish that gets the
// connection blocked; d-2 comes once the connection is known blocked. Once
// the alarm clears, both copies are confirmed, their deliveries acked, and
// the copies come back round the delay queue.
func TestBlockedPublishingConnectionDoesNotHoldAWorker(t *testing.T) {
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
	ids := []string{"d-1", "a-1", "a-2", "a-3", "d-2", "a-4", "a-5", "a-6", "s-1"}
	deferred := []string{"d-1", "d-2"}
	acked := []string{"a-1", "a-2", "a-3", "a-4", "a-5", "a-6"}
	for _, id := range ids {
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
	// s-1 is deferred at shutdown: its handler waits for stopping.
	stopping := make(chan struct{})
	c, err := New(Config{URL: node.URL(), Concurrency: 2, Prefetch: 16, ConfirmTimeout: 10 * time.Minute, Topology: top, Metrics: m,
		Logger: slog.New(slog.NewTextHandler(t.Output(), nil))},
		HandlerFunc(func(_ context.Context, d shipment.Delivery) shipment.Verdict {
			if d.Headers[shipment.HeaderOriginalRoutingKey] != nil {
				back <- d.MessageID // round the delay queue
				return shipment.Verdict{Action: shipment.Ack}
			}
			mu.Lock()
			handled[d.MessageID]++
			mu.Unlock()
			switch {
			case d.MessageID == "s-1":
				<-stopping
				return shipment.Verdict{Action: shipment.Defer, Reason: "test"}
			case strings.HasPrefix(d.MessageID, "d-"):
				return shipment.Verdict{Action: shipment.Defer, Reason: "test"}
			}
			return shipment.Verdict{Action: shipment.Ack}
		}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			close(stopping)
			cancel()
			<-done
		}
	})

	blocked := false
	// Acked, not just handled: only the deferred ones (and s-1, in its
	// handler) are left in the queue, unacked.
	waitUntil(t, 60*time.Second, "every ack-only delivery acked while the alarm lasts", func() bool {
		blocked = blocked || gauge(m.PublisherBlocked) == 1
		mu.Lock()
		n := handled["s-1"]
		mu.Unlock()
		return n == 1 && queueDepth(t, node, top.Queue) == len(deferred)+1
	})
	if !blocked {
		t.Error("the publishing connection was never reported blocked: the alarm did not block it")
	}
	if n := queueDepth(t, node, top.DelayQueue); n != 0 {
		t.Errorf("%d copies in the delay queue while the alarm lasts, want none", n)
	}
	mu.Lock()
	for _, id := range append(append([]string{}, deferred...), acked...) {
		if handled[id] != 1 {
			t.Errorf("%s handled %d times, want once: a deferral under the alarm is neither handed back nor handled again", id, handled[id])
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
	// The deferred deliveries acked once their copies were confirmed: only
	// s-1 is left.
	waitUntil(t, 60*time.Second, "the deferred deliveries acked", func() bool {
		return queueDepth(t, node, top.Queue) == 1 && queueDepth(t, node, top.DelayQueue) == 0
	})
	if n := counter(m.RepublishTimeouts); n != 0 {
		t.Errorf("%v republishes timed out, want none: a blocked connection's copies wait for it", n)
	}

	// Shutdown under a new alarm: s-1's copy waits for the blocked
	// connection when the consumer stops; its delivery is left unacked and
	// returns to the queue.
	if _, err := node.Ctl(t.Context(), "set_vm_memory_high_watermark", "0"); err != nil {
		t.Fatal(err)
	}
	alarm = true
	close(stopping)
	// The connection is blocked anew by s-1's copy, the first publish
	// since the alarm.
	waitUntil(t, 60*time.Second, "the publishing connection blocked again", func() bool {
		return gauge(m.PublisherBlocked) == 1
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Run did not return 60s after cancel")
	}
	stopped = true
	if ready, unacked := queueCounts(t, node, top.Queue); ready != 1 || unacked != 0 {
		t.Errorf("after the stop, %s has %d ready and %d unacked, want s-1 back, ready", top.Queue, ready, unacked)
	}
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

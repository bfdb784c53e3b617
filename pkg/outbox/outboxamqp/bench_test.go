package outboxamqp_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// benchPayload is about 200 bytes of JSON, like an order.created event.
var benchPayload = []byte(`{"order_id":"0b8c6d0e-2f43-4c8e-9d38-3f3c4f6f0e51","customer_id":"c-42","currency":"EUR",` +
	`"items":[{"sku":"sku-1","quantity":2,"unit_price":1250}],"total":2500,"pad":"` + strings.Repeat("x", 40) + `"}`)

const benchBacklog = 20_000

// BenchmarkRelayDrain measures how fast one relay drains a backlog of
// benchBacklog events (10,000 aggregates with two events each) to a durable
// queue. Compare its events/s with BenchmarkRawConfirmedPublish, and with
// BenchmarkRelayDrainDatabaseOnly for the share of PostgreSQL. BENCH_WORKERS
// and BENCH_BATCH override RelayConfig.Workers and BatchSize.
func BenchmarkRelayDrain(b *testing.B) {
	br := newBroker(b, false)
	br.bind("#", amqp.Table{"x-queue-mode": "default"}) // declared, not consumed: like a busy consumer
	benchDrain(b, newPublisher(b, testAMQPURL(), br.Exchange, testLogger(b, nil)), func() {
		if _, err := br.Ch.QueuePurge(br.Queue, false); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkRelayDrainDatabaseOnly is BenchmarkRelayDrain with a publisher that
// confirms everything at once: the relay's database work alone.
func BenchmarkRelayDrainDatabaseOnly(b *testing.B) {
	benchDrain(b, nopPublisher{}, func() {})
}

func benchDrain(b *testing.B, pub outbox.Publisher, reset func()) {
	pool := newTestPool(b)
	workers, _ := strconv.Atoi(os.Getenv("BENCH_WORKERS"))
	batch, _ := strconv.Atoi(os.Getenv("BENCH_BATCH"))
	var total time.Duration
	for b.Loop() {
		b.StopTimer()
		var msgs []outbox.Message
		for i := range benchBacklog {
			msgs = append(msgs, outbox.Message{AggregateType: "order", AggregateID: fmt.Sprintf("o-%d", i%(benchBacklog/2)),
				EventType: "order.created", Payload: benchPayload})
		}
		for chunk := range slices.Chunk(msgs, 5000) {
			enqueue(b, pool, chunk...)
		}
		var done atomic.Int64
		finished := make(chan struct{})
		relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{
			Workers:   workers,
			BatchSize: batch,
			Logger:    slog.New(slog.DiscardHandler),
			Observer: outboxtest.OnBatch(nil, func(r outboxtest.BatchResult) {
				if done.Add(int64(len(r.Published))) == benchBacklog {
					close(finished)
				}
			}),
		})
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		stopped := make(chan error, 1)
		b.StartTimer()
		start := time.Now()
		go func() { stopped <- relay.Run(ctx) }()
		select {
		case <-finished:
		case <-time.After(5 * time.Minute):
			b.Fatal("backlog not drained in 5 minutes")
		}
		total += time.Since(start)
		b.StopTimer()
		cancel()
		<-stopped
		reset()
		b.StartTimer()
	}
	b.ReportMetric(float64(benchBacklog*b.N)/total.Seconds(), "events/s")
}

// BenchmarkRawConfirmedPublish is the baseline: the same messages published
// straight to the same kind of queue, 1,000 confirms in flight.
func BenchmarkRawConfirmedPublish(b *testing.B) {
	br := newBroker(b, false)
	br.bind("#", amqp.Table{"x-queue-mode": "default"})
	conn, err := amqp.Dial(testAMQPURL())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		b.Fatal(err)
	}
	var total time.Duration
	for b.Loop() {
		start := time.Now()
		inflight := make([]*amqp.DeferredConfirmation, 0, 1000)
		for i := range benchBacklog {
			dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), br.Exchange, "order.created", true, false,
				amqp.Publishing{DeliveryMode: amqp.Persistent, ContentType: "application/json", MessageId: fmt.Sprint(i), Body: benchPayload})
			if err != nil {
				b.Fatal(err)
			}
			inflight = append(inflight, dc)
			if len(inflight) == cap(inflight) {
				for _, dc := range inflight {
					if !dc.Wait() {
						b.Fatal("nack")
					}
				}
				inflight = inflight[:0]
			}
		}
		for _, dc := range inflight {
			dc.Wait()
		}
		total += time.Since(start)
		b.StopTimer()
		if _, err := br.Ch.QueuePurge(br.Queue, false); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(benchBacklog*b.N)/total.Seconds(), "events/s")
}

// nopPublisher confirms everything at once.
type nopPublisher struct{}

func (nopPublisher) WaitReady(ctx context.Context) error { return nil }
func (nopPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	return make([]error, len(msgs))
}

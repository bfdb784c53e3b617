package inbox_test

import (
	"cmp"
	"context"
	"errors"
	"os"
	"slices"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// brokerURL is TEST_AMQP_URL, default the local RabbitMQ.
func brokerURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

// Through a real RabbitMQ queue (one of the test's own): an aggregate's
// versions published 2, 1, 3, then 1 again (a relay's republish), to a
// consumer that acks after the gate, defers a gap by publishing the message
// again behind the others (at most maxDeferrals times, as a delay queue
// would), and dies once after its first effect, before the ack. The effects
// are 1, 2, 3, once each.
func TestGateThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	conn, err := amqp.Dial(brokerURL())
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ at %s: %v (required under CI=true)", brokerURL(), err)
		}
		t.Skipf("RabbitMQ unreachable at %s: %v", brokerURL(), err)
	}
	defer conn.Close()
	pub, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Confirm(false); err != nil {
		t.Fatal(err)
	}
	q, err := pub.QueueDeclare("inbox-gate-test-"+inboxtest.RandomSuffix(), false, false, true, false, nil) // exclusive: gone with the connection
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	publish := func(id string, v int64, deferrals int64) {
		t.Helper()
		c, err := pub.PublishWithDeferredConfirmWithContext(ctx, "", q.Name, true, false, amqp.Publishing{
			MessageId: id, Headers: amqp.Table{"aggregate_id": "o-1", "aggregate_version": v, "x-deferrals": deferrals},
		})
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := c.WaitContext(ctx); !ok || err != nil {
			t.Fatalf("publish %s: confirmed %v, %v", id, ok, err)
		}
	}
	for _, v := range []int64{2, 1, 3, 1} {
		publish(msgID("o-1", v), v, 0)
	}

	g := newGated(t, inboxtest.Database(t), inbox.Config{})
	const maxDeferrals = 10
	results := map[string][]inbox.Result{}
	settled := 0
	crashed := false
	for settled < 4 {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if err := ch.Qos(1, 0, false); err != nil {
			t.Fatal(err)
		}
		deliveries, err := ch.ConsumeWithContext(ctx, q.Name, "", false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
	consume:
		for settled < 4 {
			var d amqp.Delivery
			select {
			case d = <-deliveries:
			case <-ctx.Done():
				t.Fatalf("%d of 4 messages settled: %v", settled, results)
			}
			v, _ := d.Headers["aggregate_version"].(int64)
			deferrals, _ := d.Headers["x-deferrals"].(int64)
			res, err := g.gate.Process(ctx, d.MessageId, inbox.Position{Aggregate: d.Headers["aggregate_id"].(string), Version: v}, g.effect(d.MessageId))
			switch {
			case errors.Is(err, inbox.ErrGap):
				if deferrals >= maxDeferrals {
					t.Fatalf("message %s still waits after %d deferrals: %v", d.MessageId, deferrals, err)
				}
				publish(d.MessageId, v, deferrals+1)
				if err := d.Ack(false); err != nil {
					t.Fatal(err)
				}
			case err != nil:
				t.Fatalf("message %s: %v", d.MessageId, err)
			case !crashed:
				// The consumer dies after the effect and the record, before
				// its ack: the broker delivers the message again.
				crashed = true
				_ = ch.Close()
				break consume
			default:
				results[d.MessageId] = append(results[d.MessageId], res)
				settled++
				if err := d.Ack(false); err != nil {
					t.Fatal(err)
				}
			}
		}
		_ = ch.Close()
	}
	want := []string{msgID("o-1", 1), msgID("o-1", 2), msgID("o-1", 3)}
	if got := g.order(t); !slices.Equal(got, want) {
		t.Fatalf("effects in the order %v, want %v", got, want)
	}
	g.exactlyOnce(t, want...)
	if r := results[msgID("o-1", 1)]; !slices.Contains(r, inbox.Duplicate) || len(r) != 2 {
		t.Fatalf("version 1 (published twice, and redelivered after a crash) settled as %v; want one Duplicate among two", r)
	}
}

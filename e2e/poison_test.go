package e2e

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// exchange is the orders events exchange (docs/events.md).
const exchange = "orders.events"

// poisoner publishes bad messages straight to the exchange, as a buggy or
// hostile producer would, bypassing the outbox.
type poisoner struct {
	// amqpURLs are the run's vhost on each broker node, straight: a
	// publish that fails goes to the next (a node killed or cut away for
	// longer than the retries, seen in make chaos-cluster).
	amqpURLs []string
	runID    string
	oversize int // body size of an oversize message
	n        atomic.Int64
}

// publish sends one poison message of kind, confirmed by the broker and
// routed to a queue (mandatory), retrying through broker outages for up to a
// minute.
func (p *poisoner) publish(ctx context.Context, kind chaos.PoisonKind) (chaos.Poison, error) {
	n := p.n.Add(1)
	id := fmt.Sprintf("%s-poison-%d", p.runID, n)
	ps := chaos.Poison{ID: id, Kind: kind, At: time.Now()}
	msg := amqp.Publishing{
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		Timestamp:    time.Now(),
		Type:         chaos.EventCreated,
		Headers: amqp.Table{
			"aggregate_type": "order", "aggregate_id": id, "event_type": chaos.EventCreated,
			"aggregate_version": int64(1), chaos.PoisonHeader: id,
		},
	}
	routingKey := chaos.EventCreated
	// A fake order id that no real order has, so no poison can touch a real
	// shipment even if a consumer wrongly applied it.
	fakeOrder := "00000000-0000-4000-8000-" + fmt.Sprintf("%012d", n)
	ps.OrderID = fakeOrder
	created := fmt.Sprintf(`{"order_id":%q,"customer_id":"poison","currency":"EUR","items":[{"sku":"x","quantity":1,"unit_price":1}],"total":1,"created_at":"2026-01-01T00:00:00Z"}`, fakeOrder)
	switch kind {
	case chaos.PoisonMalformed:
		ps.MessageID = "poison-" + id
		msg.Body = []byte(`{"order_id": "` + fakeOrder + `", "items": [`) // truncated JSON
	case chaos.PoisonMissingMessageID:
		msg.Body = []byte(created)
	case chaos.PoisonUnknownType:
		ps.MessageID = "poison-" + id
		routingKey = "order.shipped"
		msg.Type = routingKey
		msg.Headers["event_type"] = routingKey
		msg.Body = []byte(fmt.Sprintf(`{"order_id":%q,"shipped_at":"2026-01-01T00:00:00Z"}`, fakeOrder))
	case chaos.PoisonOversize:
		ps.MessageID = "poison-" + id
		pad := strings.Repeat("x", p.oversize)
		msg.Body = []byte(fmt.Sprintf(`{"order_id":%q,"customer_id":%q,"currency":"EUR","items":[],"total":1}`, fakeOrder, pad))
	default:
		return ps, fmt.Errorf("unknown poison kind %q", kind)
	}
	msg.MessageId = ps.MessageID

	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var last error
	for i := 0; ; i++ {
		err := publishConfirmed(ctx, p.amqpURLs[i%len(p.amqpURLs)], exchange, msg, routingKey)
		if err == nil {
			return ps, nil
		}
		if errors.Is(err, errUnroutable) {
			return ps, err
		}
		last = err
		select {
		case <-ctx.Done():
			return ps, fmt.Errorf("publish poison %s: %w", kind, last)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

var errUnroutable = errors.New("returned unroutable: no queue is bound for it")

// publishConfirmed publishes msg to exch with routingKey (mandatory) on a
// connection of its own and waits for the broker's confirm.
func publishConfirmed(ctx context.Context, amqpURL, exch string, msg amqp.Publishing, routingKey string) error {
	conn, err := amqp.DialConfig(amqpURL, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return err
	}
	// Drained below: the broker sends a return before the confirm of the
	// same message.
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exch, routingKey, true, false, msg)
	if err != nil {
		return err
	}
	ok, err := dc.WaitContext(ctx)
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("nacked by the broker")
	}
	select {
	case r := <-returns:
		return fmt.Errorf("routing key %q: %w (%s)", r.RoutingKey, errUnroutable, r.ReplyText)
	default:
		return nil
	}
}

// A poison publish goes to the next node when one refuses connections: in a
// make chaos-cluster run the poisoner knew only node 1, which a node fault
// held down past the publish's minute, and the run failed on the harness.
func TestPoisonerGoesToTheNextNode(t *testing.T) {
	if testing.Short() {
		t.Skip("needs RabbitMQ")
	}
	ctx := t.Context()
	vhost := fmt.Sprintf("poison_next_%d", time.Now().UnixNano())
	if err := rabbitmqctl(ctx, "list_vhosts"); err != nil {
		unavailable(t, "RabbitMQ: %v", err)
	}
	live := tempVhost(t, vhost, "")
	dead, err := withVhost(testAMQPURL(), "127.0.0.1:1", vhost)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp.Dial(live)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare("all", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind("all", "#", exchange, false, nil); err != nil {
		t.Fatal(err)
	}

	p := &poisoner{amqpURLs: []string{dead, live}, runID: "next", oversize: 10}
	pctx, cancel := context.WithTimeout(ctx, 20*time.Second) // its own retries last a minute
	defer cancel()
	if _, err := p.publish(pctx, chaos.PoisonUnknownType); err != nil {
		t.Fatalf("publish with node 1 down: %v", err)
	}
	q, err := ch.QueueDeclarePassive("all", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if q.Messages != 1 {
		t.Errorf("the queue holds %d messages, want the poison", q.Messages)
	}
}

// Package rabbitmq consumes the order events from RabbitMQ for the shipping
// service: it declares the topology, consumes with manual acks and a
// prefetch, reconnects with backoff, and carries out each delivery's verdict
// (ack, defer through the delay queue, dead-letter with a reason, or keep
// and retry), publishing with confirms before it acks.
//
// A session (one consuming connection) ends, and the next one declares the
// topology again, when the connection or channel is lost, when the broker
// cancels the consumer (its queue was deleted: basic.cancel closes the
// deliveries channel), or when a deferred or dead-lettered copy cannot be
// routed (the delay queue, the dead-letter queue or the dead-letter exchange
// is gone); while no session consumes, Consumer.Ready fails. The copies are
// published on a second connection, kept across sessions, so that a broker
// blocking publishers under a memory or disk alarm does not hold up the acks.
package rabbitmq

import (
	"cmp"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Topology names the exchanges and queues. Runs are isolated by vhost, so
// the defaults are the same everywhere.
type Topology struct {
	// Exchange is the producers' topic exchange. Default: "orders.events".
	Exchange string
	// Queue is the durable quorum queue consumed. Default: "shipping.order-events".
	Queue string
	// BindingKey binds Queue to Exchange. Default: "order.*".
	BindingKey string
	// DeadLetterExchange receives dead letters (fanout). Default: "shipping.dlx".
	DeadLetterExchange string
	// DeadLetterQueue keeps them. Default: "shipping.order-events.dlq".
	DeadLetterQueue string
	// DelayQueue holds deferred messages for Delay, then dead-letters them
	// back into Queue. Default: "shipping.order-events.delay".
	DelayQueue string
	// Delay is how long a deferred message waits. Default: 1s.
	Delay time.Duration
	// DeliveryLimit is Queue's x-delivery-limit: after that many returns to
	// the queue (crashes, connection losses), the broker dead-letters the
	// message itself (reason "delivery_limit"). Default: 20.
	DeliveryLimit int
}

// WithDefaults returns t with its defaults filled in: the names the
// consumer uses.
func (t Topology) WithDefaults() Topology {
	t.Exchange = cmp.Or(t.Exchange, "orders.events")
	t.Queue = cmp.Or(t.Queue, "shipping.order-events")
	t.BindingKey = cmp.Or(t.BindingKey, "order.*")
	t.DeadLetterExchange = cmp.Or(t.DeadLetterExchange, "shipping.dlx")
	t.DeadLetterQueue = cmp.Or(t.DeadLetterQueue, t.Queue+".dlq")
	t.DelayQueue = cmp.Or(t.DelayQueue, t.Queue+".delay")
	t.Delay = cmp.Or(t.Delay, time.Second)
	t.DeliveryLimit = cmp.Or(t.DeliveryLimit, 20)
	return t
}

func (t Topology) validate() error {
	names := []string{t.Exchange, t.Queue, t.DeadLetterExchange, t.DeadLetterQueue, t.DelayQueue}
	for _, n := range names {
		if len(n) > 255 {
			return fmt.Errorf("rabbitmq: name %q is longer than 255 bytes", n)
		}
	}
	seen := map[string]bool{}
	for _, q := range []string{t.Queue, t.DeadLetterQueue, t.DelayQueue} {
		if seen[q] {
			return fmt.Errorf("rabbitmq: queue %q is used twice in the topology", q)
		}
		seen[q] = true
	}
	if t.Exchange == t.DeadLetterExchange {
		return errors.New("rabbitmq: Exchange and DeadLetterExchange must differ")
	}
	if t.Delay < time.Millisecond {
		return fmt.Errorf("rabbitmq: Delay %v: want at least 1ms", t.Delay)
	}
	if t.DeliveryLimit < 1 {
		return fmt.Errorf("rabbitmq: DeliveryLimit %d: want at least 1", t.DeliveryLimit)
	}
	return nil
}

// Declare declares the topology idempotently. Declaring a queue that exists
// with other arguments fails (PRECONDITION_FAILED): delete it, or keep the
// arguments it was created with.
func (t Topology) Declare(ch *amqp.Channel) error {
	t = t.WithDefaults()
	if err := t.validate(); err != nil {
		return err
	}
	quorum := func(extra amqp.Table) amqp.Table {
		args := amqp.Table{"x-queue-type": "quorum"}
		for k, v := range extra {
			args[k] = v
		}
		return args
	}
	steps := []struct {
		what string
		do   func() error
	}{
		{"exchange " + t.Exchange, func() error {
			return ch.ExchangeDeclare(t.Exchange, amqp.ExchangeTopic, true, false, false, false, nil)
		}},
		{"exchange " + t.DeadLetterExchange, func() error {
			return ch.ExchangeDeclare(t.DeadLetterExchange, amqp.ExchangeFanout, true, false, false, false, nil)
		}},
		{"queue " + t.DeadLetterQueue, func() error {
			_, err := ch.QueueDeclare(t.DeadLetterQueue, true, false, false, false, quorum(nil))
			return err
		}},
		{"binding " + t.DeadLetterQueue, func() error {
			return ch.QueueBind(t.DeadLetterQueue, "", t.DeadLetterExchange, false, nil)
		}},
		{"queue " + t.Queue, func() error {
			_, err := ch.QueueDeclare(t.Queue, true, false, false, false, quorum(amqp.Table{
				"x-delivery-limit":       int64(t.DeliveryLimit),
				"x-dead-letter-exchange": t.DeadLetterExchange,
				"x-dead-letter-strategy": "at-least-once",
				"x-overflow":             "reject-publish",
			}))
			return err
		}},
		{"binding " + t.Queue, func() error {
			return ch.QueueBind(t.Queue, t.BindingKey, t.Exchange, false, nil)
		}},
		{"queue " + t.DelayQueue, func() error {
			// Expired messages go back to Queue through the default
			// exchange, at least once.
			_, err := ch.QueueDeclare(t.DelayQueue, true, false, false, false, quorum(amqp.Table{
				"x-message-ttl":             t.Delay.Milliseconds(),
				"x-dead-letter-exchange":    "",
				"x-dead-letter-routing-key": t.Queue,
				"x-dead-letter-strategy":    "at-least-once",
				"x-overflow":                "reject-publish",
			}))
			return err
		}},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			return fmt.Errorf("declare %s: %w", s.what, err)
		}
	}
	return nil
}

package deadletter

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
)

// AMQPPublisher re-publishes kept messages straight to the consumer's queue
// (through the default exchange, so no other consumer of the producers'
// exchange sees them again), persistent and mandatory, with a publisher
// confirm. Each Publish uses a connection of its own: releases are rare.
type AMQPPublisher struct {
	// URL is the broker; its path is the vhost. For a cluster it lists the
	// nodes' URLs separated by commas, tried in turn (amqpaddr).
	URL   string
	Queue string // the consumer's queue
}

var _ Publisher = AMQPPublisher{}

// Publish sends m and waits for the broker's confirm.
func (p AMQPPublisher) Publish(ctx context.Context, m Message) error {
	nodes, err := amqpaddr.New(p.URL)
	if err != nil {
		return fmt.Errorf("broker URL: %w", err)
	}
	conn, _, err := nodes.Dial(amqp.Config{Heartbeat: 10 * time.Second})
	if err != nil {
		return fmt.Errorf("dial broker: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("enable confirms: %w", err)
	}
	// A return is dispatched before the confirm that follows it.
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	headers := amqp.Table{}
	for k, v := range m.Headers {
		if v, ok := amqpValue(v); ok {
			headers[k] = v
		}
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", p.Queue, true, false, amqp.Publishing{
		MessageId: m.MessageID, Type: m.Type, ContentType: m.ContentType, DeliveryMode: amqp.Persistent,
		Timestamp: time.Now(), Headers: headers, Body: m.Body,
	})
	if err != nil {
		return fmt.Errorf("publish message %s to %s: %w", m.MessageID, p.Queue, err)
	}
	ok, err := dc.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("publish message %s to %s: waiting for confirm: %w", m.MessageID, p.Queue, err)
	}
	if !ok {
		return fmt.Errorf("publish message %s to %s: nacked", m.MessageID, p.Queue)
	}
	select {
	case <-returns:
		return fmt.Errorf("publish message %s: %w", m.MessageID, errors.New("returned: queue "+p.Queue+" does not exist"))
	default:
	}
	return nil
}

// amqpValue converts a header value read back from MongoDB to an AMQP
// field value.
func amqpValue(v any) (any, bool) {
	switch x := v.(type) {
	case string, int64, int32, int16, int8, bool, float64, float32, []byte, time.Time:
		return x, true
	case int:
		return int64(x), true
	}
	return nil, false
}

package outboxamqp_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// A relay publishing the outbox to RabbitMQ, and what a consumer receives.
func Example() {
	ctx := context.Background()
	pool, dropSchema := exampleDB() // a pool on an empty schema
	defer dropSchema()
	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	amqpURL := testAMQPURL()
	exchange := randomName("orders.events.example-") // "orders.events" in the services

	// The consumer's side: a queue bound to the exchange. The publisher
	// declares the exchange too; declaring is idempotent.
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatal(err)
	}
	if err := ch.ExchangeDeclare(exchange, "topic", true, false, false, false, nil); err != nil {
		log.Fatal(err)
	}
	defer ch.ExchangeDelete(exchange, false, false) //nolint:errcheck
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := ch.QueueBind(q.Name, "order.*", exchange, false, nil); err != nil {
		log.Fatal(err)
	}
	deliveries, err := ch.Consume(q.Name, "", true, true, false, false, nil)
	if err != nil {
		log.Fatal(err)
	}

	// The relay's side.
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: amqpURL, Exchange: exchange, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	stopped := make(chan error)
	go func() { stopped <- relay.Run(runCtx) }()

	// The service's side: events written with the business change.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx,
			outbox.Message{AggregateType: "order", AggregateID: "o-1", EventType: "order.created", Payload: []byte(`{"order_id":"o-1"}`)},
			outbox.Message{AggregateType: "order", AggregateID: "o-1", EventType: "order.cancelled", Payload: []byte(`{"order_id":"o-1"}`)},
		)
	})
	if err != nil {
		log.Fatal(err)
	}
	relay.Wake()

	for range 2 {
		d := <-deliveries
		// The message id is the outbox id and the row's creation time,
		// in microseconds: "1-1764662400123456".
		id, _, err := outbox.ParseMessageID(d.MessageId)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s outbox_id=%d %s/%s v%d %s %s\n", d.RoutingKey, id,
			d.Headers["aggregate_type"], d.Headers["aggregate_id"], d.Headers["aggregate_version"], d.ContentType, d.Body)
	}
	stop()
	if err := <-stopped; err != nil {
		log.Fatal(err)
	}
	// Output:
	// order.created outbox_id=1 order/o-1 v1 application/json {"order_id": "o-1"}
	// order.cancelled outbox_id=2 order/o-1 v2 application/json {"order_id": "o-1"}
}

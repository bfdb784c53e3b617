package doccheck_test

// The code of the README's "Using pkg/outbox and pkg/inbox" section, which is
// also the first code block of pkg/outbox's "Minimal use" and pkg/inbox's
// "Use": compiled (and vetted) here, and compared with both by
// TestReadmeCodeIsCompiled.

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/mongo"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// placeOrder stores an order and its event in one transaction: both or neither.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, orderID string, payload []byte) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id) VALUES ($1)", orderID); err != nil {
			return fmt.Errorf("insert order %s: %w", orderID, err)
		}
		err := outbox.Enqueue(ctx, tx, outbox.Message{
			AggregateType: "order",
			AggregateID:   orderID,
			EventType:     "order.created",
			Payload:       payload, // JSON
		})
		return err // ErrInvalidMessage: the broker could never take it; nothing is written
	})
}

// runRelay publishes the committed events to RabbitMQ until ctx ends.
func runRelay(ctx context.Context, pool *pgxpool.Pool, amqpURL string) error {
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		return err // ErrSchemaMissing: outbox.Migrate has not run
	}
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: amqpURL, Exchange: "orders.events"})
	if err != nil {
		return err
	}
	relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{})
	if err != nil {
		return errors.Join(err, pub.Close())
	}
	return errors.Join(relay.Run(ctx), pub.Close()) // Run returns nil once ctx ends
}

// consume applies each delivery's effect once, and acks it only after.
func consume(ctx context.Context, db *mongo.Database, deliveries <-chan amqp.Delivery, apply func(context.Context, amqp.Delivery) error) (err error) {
	in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, in.Close(context.WithoutCancel(ctx))) }()
	if err := in.EnsureIndexes(ctx); err != nil {
		return err
	}
	for d := range deliveries {
		_, err := in.Process(ctx, d.MessageId, func(ctx context.Context) error {
			return apply(ctx, d) // use this ctx: in transaction mode it carries the session
		})
		switch {
		case err == nil: // applied now, or applied before: a duplicate
			err = d.Ack(false)
		case errors.Is(err, inbox.ErrHandler), errors.Is(err, inbox.ErrInvalidMessageID):
			err = d.Reject(false) // dead-letter it (count the handler's failures first)
		default: // the database failed, or ErrTransient: deliver it again later
			err = d.Nack(false, true)
		}
		if err != nil {
			return fmt.Errorf("settle message %s: %w", d.MessageId, err)
		}
	}
	return nil
}

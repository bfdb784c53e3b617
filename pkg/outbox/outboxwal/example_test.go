package outboxwal_test

import (
	"context"
	"log"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// A relay that reads the outbox's inserts from the write-ahead log instead
// of polling: writers use outbox.Enqueue as with the polling relay. The
// server needs wal_level=logical, and the pool a role with REPLICATION (see
// the package documentation). Rows it cannot publish go to a polling relay
// it runs itself (Config.Poll); Archive keeps published rows in
// outbox_published, as the polling relay does.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: os.Getenv("AMQP_URL"), Exchange: "orders.events"})
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	relay, err := outboxwal.NewRelay(pool, pub, outboxwal.Config{Archive: true})
	if err != nil {
		log.Fatal(err)
	}
	// Run creates the publication, the slot and outbox_wal_slots when they
	// are missing, and streams until ctx ends.
	if err := relay.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

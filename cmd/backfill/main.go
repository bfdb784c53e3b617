// Command backfill replays the orders outbox's archive (outbox_published) to
// one new consumer's queue, for a service added after the events it needs
// were published (docs/adopting.md, "We added a service"):
//
//	go run ./cmd/backfill -queue billing.orders                  everything the archive holds
//	go run ./cmd/backfill -queue billing.orders -from 2030-01-02T00:00:00Z
//	go run ./cmd/backfill -queue billing.orders -aggregate order/o-1 -aggregate order/o-2
//
// Declare and bind the queue first (start the new service): the replay goes
// through RabbitMQ's default exchange to that queue alone, with publisher
// confirms and the relay's message ids and headers, so the consumers already
// bound get nothing more and the new one's inbox absorbs the overlap with the
// live flow. It is throttled (-rate, events per second), logs its progress,
// and resumes from its checkpoint (table outbox_backfill, under -name) after
// a crash; SIGTERM or SIGINT stops it after the batch in flight. It exits 0
// once every event is replayed.
//
// Environment (defaults: this machine's local services, as the services use
// them):
//
//	DATABASE_URL  postgres://postgres@127.0.0.1:5432/orders?sslmode=disable
//	AMQP_URL      amqp://guest:guest@127.0.0.1:5672/
//	LOG_LEVEL     info (logs go to stdout as JSON lines)
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "backfill:", err)
		os.Exit(1)
	}
}

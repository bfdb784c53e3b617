// Command orders runs the orders service: an HTTP API that stores orders in
// PostgreSQL and writes their events to a transactional outbox, and the relay
// that publishes those events to RabbitMQ.
//
//	orders migrate         create the database and schema, then exit
//	orders                 API and relay (the default)
//	orders relay           the relay alone; run as many as you like
//	orders outbox-status   print the outbox backlog: pending count, dead letters,
//	                       oldest age, rows blocked behind nothing
//	orders dead-letters    list, retry or discard dead-lettered events
//
// Only migrate creates the database and runs DDL (and serve with
// MIGRATE=true, for a zero-setup local run). The other commands check the
// schema read-only and fail, naming the database, when it or its schema is
// missing, outdated, or too new for this binary.
//
// Configuration comes from the environment; see internal/config.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/outbox-inbox/reference/internal/tracing"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		err = nil // SIGTERM during start-up is a clean stop, not a failure
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

const usage = `usage: orders [command]

commands:
  migrate        create the database and schema, then exit (run it first:
                 the other commands change no schema, and fail when it is
                 missing or outdated)
  serve          run the HTTP API and the relay (default); with MIGRATE=true,
                 migrate first
  relay          run the relay alone (any number may run at once)
  outbox-status  print pending count, dead letters, the oldest pending age
                 and the rows blocked behind nothing (released by the
                 relays' periodic check)
  dead-letters list [-after ID] [-limit N]
                 list dead-lettered events
  dead-letters retry ID | -all
                 put dead-lettered events back in the queue
  dead-letters discard ID -reason "..."
                 give up on a dead letter: keep it aside with the reason,
                 publish its aggregate's next events
`

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	return runTraced(ctx, args, getenv, stdout, stderr, nil)
}

// runTraced is run with the given tracing; nil sets it up from the OTEL_*
// environment (see internal/tracing).
func runTraced(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer, tel *tracing.Telemetry) error {
	cmd := "serve"
	if len(args) > 0 {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "serve":
		return serve(ctx, getenv, stderr, tel)
	case "relay":
		return runRelay(ctx, getenv, stderr, tel)
	case "outbox-status":
		return outboxStatus(ctx, getenv, stdout)
	case "dead-letters":
		return deadLetters(ctx, args, getenv, stdout)
	case "migrate":
		return migrate(ctx, getenv, stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	default:
		return fmt.Errorf("unknown command %q\n%s", cmd, usage)
	}
}

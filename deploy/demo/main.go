// Command demo runs the whole system as local processes, for machines without
// a Docker engine (`make demo` picks docker compose when there is one, and
// then runs this command with -compose for the live view alone; see
// deploy/demo.sh):
//
//	mongolocal          an embedded FerretDB on MONGO_URI's address
//	orders              the API (RELAY=false: it NOTIFYs the relays)
//	orders relay        relay-1 and relay-2, two standalone relays
//	shipping            the consumer, its inbox and its API
//	loadgen             with -load only: orders at a steady rate
//
// against this machine's PostgreSQL (database orders_demo, created on first
// run) and RabbitMQ. It expects the binaries in -bin (deploy/demo.sh builds
// them), prints where each part listens, prefixes each process's output with
// its name, restarts a process that dies (so `kill -9` one and watch it come
// back), and on SIGINT or SIGTERM stops them all: the applications first,
// then the database they write to, each with SIGTERM and a grace period.
//
// It also serves the live view (-ui-addr, default 127.0.0.1:8090): the
// pipeline's counts, each process's state, one order's journey, and buttons
// that stop and start the relays and shipping, arm the crash points and take
// the broker away (see live.go and docs/demo.md).
//
// With -compose FILE it runs nothing itself: deploy/demo.sh has started the
// compose project, and the demo serves the same live view for it, reading
// the ports compose publishes and acting through docker compose (compose.go).
//
// The services read DATABASE_URL, AMQP_URL and MONGO_URI from the demo's
// environment when set, so the demo can be pointed elsewhere like any of
// them.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// Handled, not ignored (children would inherit that): if the terminal's
	// reader is gone, e.g. `| tee` killed by the same Ctrl-C, a write fails
	// instead of killing the demo before it has stopped the processes.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	cfg, err := parseConfig(args, getenv, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	if cfg.Compose != "" {
		return runCompose(ctx, cfg, stdout)
	}
	return newDemo(cfg, stdout).run(ctx)
}

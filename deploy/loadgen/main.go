// Command loadgen places orders on the orders API at a steady rate and cancels
// a share of them, so the outbox, the relay, the broker and the shipping inbox
// all have work to do. It is the compose file's `load` profile and the guided
// demo's way to create many orders at once.
//
//	loadgen -url http://127.0.0.1:8080 -rate 20 -duration 1m -cancel 0.2
//	loadgen -n 200 -rate 100     # exactly 200 orders, as fast as 100/s
//
// Every order carries an Idempotency-Key, so a create retried after a timeout
// never places a second order. It stops by itself after -n orders or
// -duration, whichever comes first, or on SIGINT/SIGTERM, waits for the
// requests in flight, prints a summary, and exits 1 if any request failed.
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
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	g, err := newGenerator(cfg, stdout)
	if err != nil {
		return err
	}
	return g.run(ctx)
}

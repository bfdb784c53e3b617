// Command testserver serves a MongoDB server to tests that cannot embed one,
// for as long as its standard input stays open:
//
//	go run ./internal/mongolocal/testserver standalone   # an embedded FerretDB on a free port
//	go run ./internal/mongolocal/testserver replset      # a single-node replica set in a container
//
// It prints one line on standard output, then waits: "uri=<connection
// string>" when the server is up, "absent=<why>" when there can be none here
// (replset: no Docker engine answers), or "error=<what failed>". When its
// standard input ends (the process that started it closed it, or died) it
// stops the server and exits.
//
// pkg/inbox's tests start it so, from this repository, when TEST_MONGO_URI
// or TEST_MONGO_REPLSET_URI is unset: the package then needs neither
// FerretDB nor testcontainers, and a copy of it does not inherit them
// (internal/copycheck). It runs without the race detector, whatever the
// tests run with, which also keeps the server fast.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/outbox-inbox/reference/internal/mongolocal"
	"github.com/outbox-inbox/reference/internal/mongolocal/replsettest"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "testserver:", err)
		os.Exit(1)
	}
}

// run serves what args asks for until stdin ends or ctx is done.
func run(ctx context.Context, args []string, stdin io.Reader, stdout io.Writer) error {
	if len(args) != 1 {
		return errors.New("usage: testserver standalone|replset")
	}
	var uri string
	var stop func(context.Context) error
	switch args[0] {
	case "standalone":
		srv, err := mongolocal.Start(ctx, mongolocal.Config{})
		if err != nil {
			fmt.Fprintf(stdout, "error=start the embedded FerretDB: %v\n", err)
			return nil
		}
		uri, stop = srv.URI(), func(context.Context) error { return srv.Close() }
	case "replset":
		u, absent, stopContainer, err := replsettest.Start(ctx)
		stop = stopContainer
		switch {
		case absent != "":
			fmt.Fprintf(stdout, "absent=%s\n", absent)
		case err != nil:
			fmt.Fprintf(stdout, "error=%v\n", err)
		}
		if absent != "" || err != nil {
			return stopWith(stop)
		}
		uri = u
	default:
		return fmt.Errorf("unknown server %q: want standalone or replset", args[0])
	}
	fmt.Fprintf(stdout, "uri=%s\n", uri)
	ended := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		close(ended)
	}()
	select {
	case <-ended:
	case <-ctx.Done():
	}
	return stopWith(stop)
}

func stopWith(stop func(context.Context) error) error {
	if stop == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return stop(ctx)
}

// Command mongolocal serves an embedded FerretDB (SQLite backend) on the
// address of MONGO_URI, for local runs on machines without a MongoDB server:
//
//	go run ./cmd/mongolocal                       # mongodb://127.0.0.1:27017
//	MONGO_URI=mongodb://127.0.0.1:27018 go run ./cmd/mongolocal -data-dir /tmp/m
//
// It has no transactions and no TTL indexes, so pkg/inbox runs in its
// standalone mode against it. Data is kept under -data-dir (or
// MONGOLOCAL_DATA_DIR; default: mongolocal in the user cache directory, else
// ./.mongolocal) across restarts. It stops on SIGINT or SIGTERM.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"go.mongodb.org/mongo-driver/v2/x/mongo/driver/connstring"

	"github.com/outbox-inbox/reference/internal/mongolocal"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "mongolocal:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	fs := flag.NewFlagSet("mongolocal", flag.ContinueOnError)
	fs.SetOutput(stdout)
	addr := fs.String("addr", "", "TCP address to listen on (default: host:port of MONGO_URI, else 127.0.0.1:27017)")
	dataDir := fs.String("data-dir", getenv("MONGOLOCAL_DATA_DIR"), "directory for the SQLite files (env MONGOLOCAL_DATA_DIR; default: user cache dir, else ./.mongolocal)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}

	if *addr == "" {
		a, err := addrFromURI(cmp.Or(getenv("MONGO_URI"), "mongodb://127.0.0.1:27017"))
		if err != nil {
			return err
		}
		*addr = a
	}
	if *dataDir == "" {
		*dataDir = defaultDataDir()
	}

	logger := slog.New(slog.NewTextHandler(stdout, nil))
	srv, err := mongolocal.Start(ctx, mongolocal.Config{Addr: *addr, DataDir: *dataDir, Logger: logger})
	if err != nil {
		return err
	}
	logger.Info("mongolocal listening (embedded FerretDB, SQLite backend: no transactions, no TTL indexes)",
		"addr", srv.Addr(), "uri", srv.URI(), "data_dir", srv.DataDir())
	<-ctx.Done()
	logger.Info("mongolocal stopping")
	if err := srv.Close(); err != nil {
		return err
	}
	logger.Info("mongolocal stopped")
	return nil
}

// addrFromURI returns the single host:port of a mongodb:// URI; the port
// defaults to 27017.
func addrFromURI(uri string) (string, error) {
	cs, err := connstring.Parse(uri)
	if err != nil {
		return "", fmt.Errorf("MONGO_URI: %w", err)
	}
	if cs.Scheme != connstring.SchemeMongoDB || len(cs.Hosts) != 1 {
		return "", fmt.Errorf("MONGO_URI %q: want mongodb://host:port with a single host to listen on", uri)
	}
	host := cs.Hosts[0]
	if strings.HasSuffix(host, ".sock") || strings.HasPrefix(host, "/") {
		return "", fmt.Errorf("MONGO_URI %q: unix sockets are not supported, use a TCP address", uri)
	}
	if _, _, err := net.SplitHostPort(host); err != nil {
		host = net.JoinHostPort(host, "27017")
	}
	return host, nil
}

func defaultDataDir() string {
	if dir, err := os.UserCacheDir(); err == nil {
		return filepath.Join(dir, "outbox-inbox", "mongolocal")
	}
	return ".mongolocal"
}

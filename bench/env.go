package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal"
)

// env creates the run's isolated resources (a PostgreSQL database per figure,
// one RabbitMQ vhost, MongoDB databases on one embedded FerretDB) and removes
// them all in close, in reverse order.
type env struct {
	databaseURL string // an existing database to connect to for CREATE DATABASE
	amqpURL     string // the broker; its vhost is replaced by the run's own
	rabbitNode  string // the broker's Erlang node name for rabbitmqctl -n ("": its default)
	runID       string
	root        string // module root
	log         *slog.Logger

	keep bool // BENCH_KEEP: leave databases and vhosts for inspection

	mu       sync.Mutex
	cleanups []cleanup
	purposes map[string]int // how often each purpose was asked for (under mu)

	mongoOnce sync.Once
	mongo     *mongolocal.Server
	mongoErr  error

	ferretDBVersion string

	// The run's FerretDB process (bench.ferretProcess), started on first use.
	ferretProcOnce sync.Once
	ferretProcURI  string
	ferretProcPID  int
	ferretProcErr  error
}

type cleanup struct {
	what string
	fn   func(context.Context) error
}

func newEnv(databaseURL, amqpURL, root string, log *slog.Logger) *env {
	return &env{databaseURL: databaseURL, amqpURL: amqpURL, runID: randomHex(4), root: root, log: log}
}

func (e *env) onClose(what string, fn func(context.Context) error) {
	if e.keep && (strings.HasPrefix(what, "database ") || strings.HasPrefix(what, "vhost ")) {
		e.log.Info("kept for inspection (BENCH_KEEP)", "resource", what)
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cleanups = append(e.cleanups, cleanup{what, fn})
}

// close runs the cleanups, last registered first, each with its own timeout,
// and returns every failure.
func (e *env) close() error {
	e.mu.Lock()
	cs := e.cleanups
	e.cleanups = nil
	e.mu.Unlock()
	var errs []error
	for i := len(cs) - 1; i >= 0; i-- {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		if err := cs[i].fn(ctx); err != nil {
			errs = append(errs, fmt.Errorf("clean up %s: %w", cs[i].what, err))
		}
		cancel()
	}
	return errors.Join(errs...)
}

// unique returns purpose the first time it is asked for, then purpose_2,
// purpose_3...: two figures asking for the same purpose (both e2e figures
// have a "wake" variant) get resources of their own, and each is cleaned up
// once.
func (e *env) unique(purpose string) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.purposes == nil {
		e.purposes = map[string]int{}
	}
	e.purposes[purpose]++
	if n := e.purposes[purpose]; n > 1 {
		return fmt.Sprintf("%s_%d", purpose, n)
	}
	return purpose
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newDatabase creates a database of its own for one figure, dropped on close,
// and returns a pool configuration for it (not connected yet).
func (e *env) newDatabase(ctx context.Context, purpose string) (*pgxpool.Config, error) {
	name := "bench_" + e.runID + "_" + e.unique(purpose)
	admin, err := pgx.Connect(ctx, e.databaseURL)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL at %s: %w", redact(e.databaseURL), err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return nil, fmt.Errorf("create database %s: %w", name, err)
	}
	e.onClose("database "+name, func(ctx context.Context) error {
		c, err := pgx.Connect(ctx, e.databaseURL)
		if err != nil {
			return err
		}
		defer c.Close(ctx)
		_, err = c.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		return err
	})
	cfg, err := pgxpool.ParseConfig(e.databaseURL)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	cfg.ConnConfig.Database = name
	return cfg, nil
}

// openDatabase is newDatabase, connected and migrated by migrate; the caller
// closes the pool. The configuration is returned for relays' own pools.
func (e *env) openDatabase(ctx context.Context, purpose string, migrate func(context.Context, *pgxpool.Pool) error) (*pgxpool.Config, *pgxpool.Pool, error) {
	cfg, err := e.newDatabase(ctx, purpose)
	if err != nil {
		return nil, nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	if err := migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, nil, err
	}
	return cfg, pool, nil
}

// newVhost creates a RabbitMQ vhost of its own, deleted on close, and returns
// the broker URL pointing at it. There is no AMQP method to create a vhost,
// so it runs rabbitmqctl, which must be on PATH and allowed to talk to the
// node (true as root on this machine).
func (e *env) newVhost(ctx context.Context, purpose string) (string, error) {
	u, err := url.Parse(e.amqpURL)
	if err != nil {
		return "", fmt.Errorf("parse AMQP URL: %w", err)
	}
	user := "guest"
	if u.User != nil && u.User.Username() != "" {
		user = u.User.Username()
	}
	vhost := "bench-" + e.runID + "-" + e.unique(purpose)
	if err := e.rabbitmqctl(ctx, "add_vhost", vhost); err != nil {
		return "", err
	}
	e.onClose("vhost "+vhost, func(ctx context.Context) error { return e.rabbitmqctl(ctx, "delete_vhost", vhost) })
	if err := e.rabbitmqctl(ctx, "set_permissions", "-p", vhost, user, ".*", ".*", ".*"); err != nil {
		return "", err
	}
	u.Path = "/" + vhost
	u.RawPath = "/" + url.PathEscape(vhost)
	return u.String(), nil
}

func (e *env) rabbitmqctl(ctx context.Context, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	flags := []string{"-q"}
	if e.rabbitNode != "" {
		flags = append(flags, "-n", e.rabbitNode)
	}
	cmd := exec.CommandContext(ctx, "rabbitmqctl", append(flags, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}

// mongoServer returns the run's embedded FerretDB, started on first use.
func (e *env) mongoServer(ctx context.Context) (*mongolocal.Server, error) {
	e.mongoOnce.Do(func() {
		dir, err := os.MkdirTemp("", "bench-ferretdb-")
		if err != nil {
			e.mongoErr = err
			return
		}
		e.onClose("FerretDB data "+dir, func(context.Context) error { return os.RemoveAll(dir) })
		// The server lives for the whole run: its context is the run's, and
		// close stops it before anything else it depends on is removed.
		srv, err := mongolocal.Start(context.WithoutCancel(ctx), mongolocal.Config{DataDir: dir})
		if err != nil {
			e.mongoErr = err
			return
		}
		e.mongo = srv
		e.onClose("embedded FerretDB", func(ctx context.Context) error { return srv.Stop(ctx) })
		e.readFerretVersion(ctx, srv.URI())
	})
	return e.mongo, e.mongoErr
}

// newMongoDatabase returns a fresh database on the embedded FerretDB and a
// connected client, both cleaned up on close.
func (e *env) newMongoDatabase(ctx context.Context, purpose string, poolSize uint64) (*mongo.Database, string, error) {
	srv, err := e.mongoServer(ctx)
	if err != nil {
		return nil, "", fmt.Errorf("start embedded FerretDB: %w", err)
	}
	return e.newMongoDatabaseAt(ctx, srv.URI(), purpose, poolSize)
}

// newMongoDatabaseAt is newMongoDatabase on the server at uri.
func (e *env) newMongoDatabaseAt(ctx context.Context, uri, purpose string, poolSize uint64) (*mongo.Database, string, error) {
	name := "bench_" + e.runID + "_" + e.unique(purpose)
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetMaxPoolSize(poolSize))
	if err != nil {
		return nil, "", fmt.Errorf("connect to FerretDB: %w", err)
	}
	db := client.Database(name)
	e.onClose("mongo database "+name, func(ctx context.Context) error {
		return errors.Join(db.Drop(ctx), client.Disconnect(ctx))
	})
	if err := client.Ping(ctx, nil); err != nil {
		return nil, "", fmt.Errorf("ping FerretDB: %w", err)
	}
	return db, uri, nil
}

// moduleRoot finds the directory holding the module's go.mod, from the
// working directory up.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.Contains(b, []byte("module github.com/outbox-inbox/reference")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run the benchmark from inside the repository (no go.mod of github.com/outbox-inbox/reference found above the working directory)")
		}
		dir = parent
	}
}

// redact hides a URL's password for error messages.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

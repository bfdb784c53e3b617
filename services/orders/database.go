package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
)

// Only `orders migrate` (and `orders serve` with MIGRATE=true) creates the
// database and runs the schemas' DDL. Every other command opens the database
// as it is and checks, from the catalog alone, that the schema it uses is
// there and that this binary may run against it (outbox.CheckSchema refuses a
// schema an older binary would mishandle). The outbox's Migrate locks nothing
// when the schema is up to date, and takes each lock of a real upgrade with a
// short lock_timeout, retried, so running it at every start is safe; the
// commands that do not need to change anything still do not.

// migrate creates the database of DATABASE_URL if it does not exist and
// applies the orders and outbox schemas.
func migrate(ctx context.Context, getenv func(string) string, stdout, logOut io.Writer) error {
	cfg, err := config.FromEnv(getenv)
	if err != nil {
		return err
	}
	logger := newLogger(cfg, logOut).With("role", "migrate")
	pcfg, err := postgres.PoolConfig(cfg.DatabaseURL, cfg.DatabasePooler)
	if err != nil {
		return err
	}
	pool, err := postgres.Open(ctx, pcfg, logger)
	if err != nil {
		return err
	}
	pool.Close()
	fmt.Fprintln(stdout, "orders: database and schema are up to date")
	return nil
}

// serveDatabase opens the database for `orders serve`: it must exist and hold
// both schemas, unless MIGRATE=true, which creates and migrates it first.
// It waits for a server it cannot reach yet (awaitDatabase), reporting to
// status.
func serveDatabase(ctx context.Context, cfg config.Config, tp trace.TracerProvider, logger *slog.Logger, status *startupStatus) (*pgxpool.Pool, error) {
	target, err := databaseTarget(cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	return awaitDatabase(ctx, logger, dbWait{target: target, status: status}, func() (*pgxpool.Pool, error) {
		return openServeDatabase(ctx, cfg, tp, logger)
	})
}

// relayDatabase opens the database for `orders relay`: it must exist and
// hold the outbox schema. It waits for a server it cannot reach yet
// (awaitDatabase), reporting to status.
func relayDatabase(ctx context.Context, cfg config.Config, tp trace.TracerProvider, logger *slog.Logger, status *startupStatus) (*pgxpool.Pool, error) {
	target, err := databaseTarget(cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	return awaitDatabase(ctx, logger, dbWait{target: target, status: status}, func() (*pgxpool.Pool, error) {
		return connect(ctx, cfg, false, tp)
	})
}

func openServeDatabase(ctx context.Context, cfg config.Config, tp trace.TracerProvider, logger *slog.Logger) (*pgxpool.Pool, error) {
	if cfg.Migrate {
		pcfg, err := postgres.PoolConfig(cfg.DatabaseURL, cfg.DatabasePooler)
		if err != nil {
			return nil, err
		}
		pool, err := postgres.Open(ctx, pcfg, logger.With("role", "migrate"))
		if err != nil {
			return nil, err
		}
		pool.Close()
	}
	return connect(ctx, cfg, true, tp)
}

// databaseTarget names the database of databaseURL for the logs: db_address
// (host:port, and those of its fallbacks, comma-separated), db_name and
// db_user. Never the password.
func databaseTarget(databaseURL string) ([]any, error) {
	cfg, err := pgconn.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	addrs := []string{net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))}
	for _, f := range cfg.Fallbacks {
		if a := net.JoinHostPort(f.Host, strconv.Itoa(int(f.Port))); !slices.Contains(addrs, a) {
			addrs = append(addrs, a)
		}
	}
	return []any{"db_address", strings.Join(addrs, ","), "db_name", cfg.Database, "db_user", cfg.User}, nil
}

// dbWait is what awaitDatabase waits for and where it reports.
type dbWait struct {
	// target names the database in every line the wait logs
	// (databaseTarget).
	target []any
	// status gets each attempt's outcome, for the start-up /readyz. Nil:
	// the wait keeps its own.
	status *startupStatus
	// warnEvery is how often a wait that goes on says so at warn level
	// ("still waiting for the database"): first after warnEvery, then
	// every warnEvery. Zero: 30 s.
	warnEvery time.Duration
}

// awaitDatabase calls open until it succeeds, fails for a reason waiting
// cannot fix, or ctx ends. A long-running command (serve, relay) started
// while PostgreSQL (or the PgBouncer in front of it) is down, restarting or
// refusing connections during its start-up waits for it, with backoff
// (100ms doubling to 5s), instead of exiting: an orchestrator restarting a
// command that exits at once backs off for minutes, far longer than a
// database restart. A database that does not exist, a failed
// authentication or a schema to migrate are errors at once. The operator's
// commands do not wait.
//
// The wait logs its first failure, and each new error, at warn level (the
// others at debug), and every w.warnEvery that it is still waiting, with
// the target, the last error and how long it has waited: a DATABASE_URL
// naming the wrong host waits too, and that line is what tells it from an
// outage.
func awaitDatabase(ctx context.Context, logger *slog.Logger, w dbWait, open func() (*pgxpool.Pool, error)) (*pgxpool.Pool, error) {
	logger = logger.With(w.target...)
	status := w.status
	if status == nil {
		status = newStartupStatus()
	}
	every := w.warnEvery
	if every <= 0 {
		every = 30 * time.Second
	}
	stillWaiting := make(chan struct{})
	var warner sync.WaitGroup
	warner.Go(func() { warnWhileWaiting(ctx, logger, status, every, stillWaiting) })
	defer func() {
		close(stillWaiting)
		warner.Wait()
	}()

	wait := 100 * time.Millisecond
	var lastMsg string
	for attempt := 1; ; attempt++ {
		pool, err := open()
		if err == nil {
			status.succeeded()
			if attempt > 1 {
				_, _, waited, _ := status.waiting()
				logger.InfoContext(ctx, "database reached", "attempt", attempt, "waited", waited.Round(time.Millisecond))
			}
			return pool, nil
		}
		if !unreachable(err) {
			return nil, err
		}
		status.failed(err)
		level := slog.LevelDebug
		if msg := err.Error(); msg != lastMsg {
			level, lastMsg = slog.LevelWarn, msg
		}
		logger.Log(ctx, level, "database unreachable, waiting for the database", "error", err, "attempt", attempt, "retry_in", wait)
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w (given up waiting: %w)", err, context.Cause(ctx))
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// warnWhileWaiting logs "still waiting for the database" every every until
// done is closed or ctx ends. It runs beside the attempts, so that one that
// hangs (a host that drops packets: the connection attempt waits for the
// system's TCP timeout, minutes) is reported too.
func warnWhileWaiting(ctx context.Context, logger *slog.Logger, status *startupStatus, every time.Duration, done <-chan struct{}) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-ctx.Done():
			return
		case <-t.C:
		}
		attempts, lastErr, waited, _ := status.waiting()
		last := "none yet: the first attempt has not ended"
		if lastErr != nil {
			last = lastErr.Error()
		}
		logger.WarnContext(ctx, "still waiting for the database", "waited", waited.Round(time.Millisecond), "attempts", attempts,
			"last_error", last, "hint", "the database is down or unreachable, or DATABASE_URL names the wrong host or port")
	}
}

// unreachable reports whether err says the server could not be reached or
// would not take a connection yet, which waiting may fix: no answer, a
// connection cut, a server starting up, shutting down, or full, or a
// connection exception (SQLSTATE class 08). PgBouncer answers every error of
// its own with 08P01: query_wait_timeout or "server login has been failing"
// while its PostgreSQL server is down, "no more connections allowed" when it
// is full.
func unreachable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57P01", "57P02", "57P03", "53300": // admin_shutdown, crash_shutdown, cannot_connect_now, too_many_connections
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08") // connection_exception: 08000, 08003, 08006, 08001, 08004, 08P01
	}
	// A connection attempt that failed for another reason (the server
	// refusing TLS, an unknown authentication method) is a mistake of the
	// configuration: waiting would not fix it.
	var netErr net.Error
	return errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET)
}

// openDatabase opens the database of DATABASE_URL for the operator's commands:
// it must exist and hold the outbox schema.
func openDatabase(ctx context.Context, getenv func(string) string) (*pgxpool.Pool, error) {
	cfg, err := config.FromEnv(getenv)
	if err != nil {
		return nil, err
	}
	return connect(ctx, cfg, false, nil)
}

// connect opens DATABASE_URL's database without creating or changing
// anything, and checks its outbox schema, and with ordersTables the orders
// service's tables too. A missing database, or a schema that is missing or
// outdated, is an error that names the database and says to run `orders
// migrate`; a schema too new for this binary says so. With TRACE_DB=true,
// every statement gets a span from tp (nil: none).
func connect(ctx context.Context, c config.Config, ordersTables bool, tp trace.TracerProvider) (*pgxpool.Pool, error) {
	cfg, err := postgres.PoolConfig(c.DatabaseURL, c.DatabasePooler)
	if err != nil {
		return nil, err
	}
	if tp != nil && c.Tracing.DatabaseSpans {
		cfg.ConnConfig.Tracer = databaseTracer(tp)
	}
	name := cfg.ConnConfig.Database
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to database %q: %w", name, err)
	}
	if err := checkDatabase(ctx, pool, name, ordersTables); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

func checkDatabase(ctx context.Context, pool *pgxpool.Pool, name string, ordersTables bool) error {
	const hint = "run `orders migrate` first"
	err := pool.Ping(ctx)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "3D000" { // invalid_catalog_name
		return fmt.Errorf("database %q does not exist (DATABASE_URL): %s: %w", name, hint, err)
	}
	if err != nil {
		return fmt.Errorf("connect to database %q: %w", name, err)
	}
	if err := outbox.CheckSchema(ctx, pool); errors.Is(err, outbox.ErrSchemaTooNew) {
		return fmt.Errorf("database %q: %w", name, err) // migrate cannot help: this binary is too old
	} else if err != nil {
		return fmt.Errorf("database %q: %w; %s", name, err, hint)
	}
	if !ordersTables {
		return nil
	}
	for _, table := range []string{"orders", "idempotency_keys"} {
		var found bool
		if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&found); err != nil {
			return fmt.Errorf("database %q: check table %q: %w", name, table, err)
		}
		if !found {
			return fmt.Errorf("database %q: table %q is missing; %s", name, table, hint)
		}
	}
	return nil
}

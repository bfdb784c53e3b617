package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
)

// A relay (or an API) started while PostgreSQL is down, restarting or not
// accepting connections yet waits for it instead of exiting: an exit at start
// during a short database outage would put it in a restart loop whose backoff
// (an orchestrator's) outlasts the outage by minutes. Errors no wait can fix
// (a database that does not exist, a schema to migrate) still stop it at once.
func TestRelayWaitsForADatabaseThatIsNotUpYet(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	dbURL := migratedDatabaseURL(t)
	deliveries := bindQueue(t, amqpURL)

	// The database's address, through a listener that hangs up on every
	// connection until the database "comes up". It stays bound all along, so
	// no other test can be handed its port meanwhile.
	gate, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = gate.Close() })
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	var up atomic.Bool
	go forward(gate, u.Host, &up)
	u.Host = gate.Addr().String()
	p := start(t, map[string]string{
		"DATABASE_URL": u.String(), "AMQP_URL": amqpURL, "RELAY_POLL_INTERVAL": "50ms",
	}, "relay")

	select {
	case err := <-p.done:
		t.Fatalf("the relay exited while the database was unreachable: %v", err)
	case <-time.After(1500 * time.Millisecond):
	}
	if !strings.Contains(p.logs.String(), "waiting for the database") {
		t.Errorf("the relay did not say it waits for the database:\n%s", p.logs.String())
	}

	up.Store(true) // the database comes up
	// And the relay publishes.
	pool := connectPool(t, dbURL)
	err = pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(t.Context(), tx, outbox.Message{
			AggregateType: "order", AggregateID: "o-late", EventType: "order.created", Payload: []byte(`{}`)})
	})
	if err != nil {
		t.Fatal(err)
	}
	if m := receive(t, deliveries); m.Headers["aggregate_id"] != "o-late" {
		t.Fatalf("published %v, want the event of o-late", m.Headers)
	}
}

// forward copies each connection accepted on ln to target and back once up
// holds, and hangs up on it before.
func forward(ln net.Listener, target string, up *atomic.Bool) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			if !up.Load() {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				return
			}
			defer up.Close()
			go func() { _, _ = io.Copy(up, c); _ = up.(*net.TCPConn).CloseWrite() }()
			_, _ = io.Copy(c, up)
		}()
	}
}

// What the start waits out, and what stops it at once.
func TestUnreachableTellsAnOutageFromAMistake(t *testing.T) {
	_, refused := pgconn.Connect(t.Context(), "postgres://postgres@"+freeAddr(t)+"/x?sslmode=disable&connect_timeout=5")
	if refused == nil {
		t.Fatal("connected to a port nothing listens on")
	}
	// A server that hangs up at once, as one stopping does.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	_, hungUp := pgconn.Connect(t.Context(), "postgres://postgres@"+ln.Addr().String()+"/x?sslmode=disable&connect_timeout=5")
	if hungUp == nil {
		t.Fatal("connected to a server that hangs up")
	}
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", refused, true},
		{"a server hanging up", hungUp, true},
		{"a refused TLS handshake", fmt.Errorf("failed to connect: %w", errors.New("server refused TLS connection")), false},
		{"a connection cut mid-query", fmt.Errorf("outbox check schema: %w", io.ErrUnexpectedEOF), true},
		{"a network error", &net.OpError{Op: "read", Err: syscall.ECONNRESET}, true},
		{"the server starting up", &pgconn.PgError{Code: "57P03"}, true},
		{"the server shutting down", &pgconn.PgError{Code: "57P01"}, true},
		{"too many connections", &pgconn.PgError{Code: "53300"}, true},
		{"PgBouncer without its server", fmt.Errorf("connect: %w", &pgconn.PgError{Severity: "FATAL", Code: "08P01", Message: "query_wait_timeout"}), true},
		{"a connection failure", &pgconn.PgError{Code: "08006"}, true},
		{"no such database", fmt.Errorf("database %q does not exist: %w", "x", &pgconn.PgError{Code: "3D000"}), false},
		{"a wrong password", &pgconn.PgError{Code: "28P01"}, false},
		{"the schema to migrate", fmt.Errorf("database x: %w", outbox.ErrSchemaMissing), false},
		{"a schema too new", outbox.ErrSchemaTooNew, false},
	} {
		if got := unreachable(c.err); got != c.want {
			t.Errorf("%s (%v): unreachable = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}

// SIGTERM while waiting for the database ends the wait at once, with an
// error main takes for a clean stop (it wraps context.Canceled).
func TestAwaitDatabaseStopsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(300*time.Millisecond, cancel)
	start := time.Now()
	_, err := awaitDatabase(ctx, slog.New(slog.DiscardHandler), dbWait{}, func() (*pgxpool.Pool, error) {
		return nil, &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v, want one wrapping context.Canceled", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the wait ended %v after the start, long after its context", d)
	}
}

// While `serve` or the standalone relay waits for the database, its HTTP
// server already answers: /healthz 200, since the process is alive and
// doing what it should (a liveness probe that got no answer would kill it
// and put it into the restart loop the wait avoids), and /readyz 503 with a
// body saying what it waits for and the last attempt's error. Once the
// database answers, /readyz answers 200 and the API takes orders.
func TestHealthzAnswersWhileWaitingForTheDatabase(t *testing.T) {
	t.Parallel()
	dbURL := migratedDatabaseURL(t)
	for _, cmd := range []string{"serve", "relay"} {
		t.Run(cmd, func(t *testing.T) {
			t.Parallel()
			gate, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = gate.Close() })
			u, err := url.Parse(dbURL)
			if err != nil {
				t.Fatal(err)
			}
			var up atomic.Bool
			go forward(gate, u.Host, &up)
			u.Host = gate.Addr().String()
			addr := freeAddr(t)
			p := start(t, map[string]string{
				"DATABASE_URL": u.String(), "AMQP_URL": newVhost(t), "HTTP_ADDR": addr,
				"RELAY_POLL_INTERVAL": "50ms",
			}, cmd)
			base := "http://" + addr

			if status, body := probe(t, p, base+"/healthz", func(int, map[string]any) bool { return true }); status != http.StatusOK || body["status"] != "ok" {
				t.Fatalf("/healthz while waiting for the database: %d %v, want 200", status, body)
			}
			// Once an attempt has failed, /readyz names its error.
			status, body := probe(t, p, base+"/readyz", func(_ int, b map[string]any) bool { return b["database"] != nil })
			if status != http.StatusServiceUnavailable || body["status"] != "starting" || body["reason"] != "waiting for the database" {
				t.Fatalf("/readyz while waiting for the database: %d %v, want 503, status starting, reason waiting for the database", status, body)
			}
			if msg, _ := body["database"].(string); !strings.Contains(msg, "connect to database") {
				t.Errorf("/readyz names the error %q, want the failed attempt's", msg)
			}
			if status, _ := probe(t, p, base+"/orders/o-1", func(int, map[string]any) bool { return true }); status != http.StatusServiceUnavailable {
				t.Errorf("GET /orders/o-1 while waiting for the database: %d, want 503", status)
			}
			select {
			case err := <-p.done:
				p.done <- err
				t.Fatalf("orders %s exited while waiting for the database: %v", cmd, err)
			default:
			}

			up.Store(true) // the database comes up
			if status, body := probe(t, p, base+"/readyz", func(s int, _ map[string]any) bool { return s == http.StatusOK }); body["status"] != "ready" {
				t.Fatalf("/readyz once the database is up: %d %v", status, body)
			}
			if status, _ := probe(t, p, base+"/healthz", func(int, map[string]any) bool { return true }); status != http.StatusOK {
				t.Fatalf("/healthz once the database is up: %d", status)
			}
			if cmd == "serve" {
				if status, o := post(t, base+"/orders", orderBody); status != http.StatusCreated {
					t.Fatalf("create once the database is up: %d %v", status, o)
				}
			}
		})
	}
}

// probe GETs u until it answers with a JSON body that done accepts, and
// returns that answer. It fails the test when p exits first, or after 30 s.
func probe(t *testing.T, p *process, u string, done func(int, map[string]any) bool) (int, map[string]any) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for {
		resp, err := http.Get(u)
		if err != nil {
			last = err.Error()
		} else {
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			last = resp.Status + " " + string(raw)
			var body map[string]any
			if err := json.Unmarshal(raw, &body); err == nil && done(resp.StatusCode, body) {
				return resp.StatusCode, body
			}
		}
		select {
		case err := <-p.done:
			p.done <- err // for start's cleanup
			t.Fatalf("the process exited before GET %s answered: %v", u, err)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: no answer wanted in 30s; last: %s", u, last)
		}
	}
}

// A DATABASE_URL naming a host that does not exist waits as an outage does
// (the name may be a service not yet in DNS), but not silently: every
// warnEvery the wait logs a warning naming the database it waits for (its
// address, name and user, never the password), the last error and how long
// it has waited.
func TestAWaitThatGoesOnSaysSo(t *testing.T) {
	t.Parallel()
	const password = "pw-never-logged"
	cfg, err := config.FromEnv(func(k string) string {
		if k == "DATABASE_URL" {
			return "postgres://orders:" + password + "@orders-db.invalid:5433/orders_prod?sslmode=disable&connect_timeout=2"
		}
		return ""
	})
	if err != nil {
		t.Fatal(err)
	}
	target, err := databaseTarget(cfg.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	logger := newLogger(cfg, &logs)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := awaitDatabase(ctx, logger, dbWait{target: target, warnEvery: 200 * time.Millisecond}, func() (*pgxpool.Pool, error) {
			return connect(ctx, cfg, false, nil)
		})
		done <- err
	}()

	// Two warnings, the last with an attempt's error (the first may come
	// while the first lookup of the name is still under way).
	warnings := func() (ws []map[string]any) {
		for line := range strings.Lines(logs.String()) {
			var rec map[string]any
			if err := json.Unmarshal([]byte(line), &rec); err != nil {
				t.Fatalf("log line %q: %v", line, err)
			}
			if rec["msg"] == "still waiting for the database" {
				ws = append(ws, rec)
			}
		}
		return ws
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if ws := warnings(); len(ws) >= 2 && strings.Contains(fmt.Sprint(ws[len(ws)-1]["last_error"]), "orders-db.invalid") {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("awaitDatabase returned while the host does not exist: %v\nlogs:\n%s", err, logs.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no two warnings that the wait goes on in 30 s, one due every 200 ms, the last naming the error:\n%s", logs.String())
		}
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("awaitDatabase: %v, want it to wait until its context ends", err)
	}
	var prev time.Duration
	for _, w := range warnings() {
		if w["level"] != "WARN" || w["db_address"] != "orders-db.invalid:5433" || w["db_name"] != "orders_prod" || w["db_user"] != "orders" {
			t.Errorf("warning %v: want level WARN and the target orders-db.invalid:5433, orders_prod, orders", w)
		}
		if last, _ := w["last_error"].(string); last == "" {
			t.Errorf("warning %v: no last_error", w)
		}
		waited, err := time.ParseDuration(fmt.Sprint(w["waited"]))
		if err != nil || waited <= prev {
			t.Errorf("warning %v: waited %v, want a duration after the previous one (%v)", w, w["waited"], prev)
		}
		prev = waited
	}
	if strings.Contains(logs.String(), password) {
		t.Errorf("the logs hold the password:\n%s", logs.String())
	}
}

package main

import (
	"context"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/internal/pgbouncertest"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

// bouncedDatabase creates a database of the test's own (directly, dropped
// when the test ends) and starts a PgBouncer in transaction pooling in front
// of the server. It returns the URL of the database through PgBouncer.
func bouncedDatabase(t *testing.T, opts pgbouncertest.Options) (*pgbouncertest.Bouncer, string, string) {
	t.Helper()
	direct := newDatabaseURL(t)
	name := databaseName(t, direct)
	admin := pgtest.Connect(t)
	if _, err := admin.Exec(t.Context(), "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	b := pgbouncertest.Start(t, opts)
	return b, b.URL(name, nil), direct
}

// A process killed and started again behind the same transaction-pooling
// PgBouncer finds the server connections its predecessor used, with the
// prepared statements it left there: pgx's statement cache names them after
// the query text, so the new process's first statements collided with them
// ("prepared statement "stmtcache_..." already exists", SQLSTATE 42P05) and
// every start failed. With DATABASE_POOLER=transaction each command runs
// without named prepared statements, and starts again and again.
func TestCommandsStartAgainBehindTransactionPooler(t *testing.T) {
	t.Parallel()
	// One server connection: every process gets the one its predecessor used.
	_, dbURL, _ := bouncedDatabase(t, pgbouncertest.Options{PoolSize: 1})
	env := map[string]string{"DATABASE_URL": dbURL, "DATABASE_POOLER": "transaction"}

	for i := range 3 {
		if out, err := runCommand(t.Context(), env, "migrate"); err != nil {
			t.Fatalf("orders migrate, run %d: %v\n%s", i+1, err, out)
		}
	}
	for _, args := range [][]string{{"outbox-status"}, {"outbox-status"}, {"dead-letters", "list"}, {"dead-letters", "list"}} {
		if out, err := runCommand(t.Context(), env, args...); err != nil {
			t.Fatalf("orders %v: %v\n%s", args, err, out)
		}
	}

	// The API with its relay, killed (its context cancelled) and started
	// again, twice: each must come up and take orders.
	amqpURL := newVhost(t)
	for i := range 3 {
		addr := freeAddr(t)
		ctx, cancel := context.WithCancel(t.Context())
		var logs syncBuffer
		srvEnv := map[string]string{"DATABASE_URL": dbURL, "DATABASE_POOLER": "transaction",
			"AMQP_URL": amqpURL, "HTTP_ADDR": addr}
		done := make(chan error, 1)
		go func() { done <- run(ctx, nil, func(k string) string { return srvEnv[k] }, &logs, &logs) }()
		base := "http://" + addr
		waitServing(t, base, done, &logs)
		if status, o := post(t, base+"/orders", orderBody); status != 201 {
			t.Fatalf("serve, run %d: create: %d %v\nlogs:\n%s", i+1, status, o, logs.String())
		}
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("serve, run %d: %v\nlogs:\n%s", i+1, err, logs.String())
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("serve, run %d did not stop", i+1)
		}
	}
}

// waitServing waits for base's /readyz to answer 200, failing the test if the
// process returns first.
func waitServing(t *testing.T, base string, done <-chan error, logs *syncBuffer) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if status, _ := getStatus(base + "/readyz"); status == 200 {
			return
		}
		select {
		case err := <-done:
			t.Fatalf("process returned before it was ready: %v\nlogs:\n%s", err, logs.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready after 30s\nlogs:\n%s", base, logs.String())
		}
	}
}

func getStatus(u string) (int, error) {
	resp, err := http.Get(u)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// startBehindBouncer migrates the database behind b and starts a standalone
// relay and an API without relay (which NOTIFYs on every write), both through
// b, with extra settings for the relay. It returns the relay's and the API's
// base URLs.
func startBehindBouncer(t *testing.T, dbURL, amqpURL string, relayEnv map[string]string) (relay *process, relayBase, apiBase string) {
	t.Helper()
	env := map[string]string{"DATABASE_URL": dbURL, "DATABASE_POOLER": "transaction", "AMQP_URL": amqpURL}
	if out, err := runCommand(t.Context(), env, "migrate"); err != nil {
		t.Fatalf("orders migrate: %v\n%s", err, out)
	}
	relayAddr, apiAddr := freeAddr(t), freeAddr(t)
	rEnv := map[string]string{"HTTP_ADDR": relayAddr}
	for k, v := range env {
		rEnv[k] = v
	}
	for k, v := range relayEnv {
		rEnv[k] = v
	}
	relay = start(t, rEnv, "relay")
	aEnv := map[string]string{"HTTP_ADDR": apiAddr, "RELAY": "false"}
	for k, v := range env {
		aEnv[k] = v
	}
	start(t, aEnv)
	waitReady(t, "http://"+relayAddr)
	waitReady(t, "http://"+apiAddr)
	return relay, "http://" + relayAddr, "http://" + apiAddr
}

// Behind a transaction pooler LISTEN cannot work: the relay finds at start
// that its own notification does not come back, says so in its log and in
// outbox_listen_fallback, and publishes by polling.
func TestRelayBehindTransactionPoolerFallsBackToPolling(t *testing.T) {
	t.Parallel()
	_, dbURL, _ := bouncedDatabase(t, pgbouncertest.Options{})
	amqpURL := newVhost(t)
	deliveries := bindQueue(t, amqpURL)
	relay, relayBase, apiBase := startBehindBouncer(t, dbURL, amqpURL, map[string]string{"RELAY_POLL_INTERVAL": "200ms"})

	waitMetrics(t, relayBase, "\noutbox_listen_fallback 1\n")
	if !strings.Contains(relay.logs.String(), "notifications do not arrive on the LISTEN connection, falling back to polling") {
		t.Errorf("no warning in the relay's log:\n%s", relay.logs.String())
	}
	status, o := post(t, apiBase+"/orders", orderBody)
	if status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	if m := receive(t, deliveries); m.Headers["aggregate_id"] != o["id"] {
		t.Fatalf("message %s %v, want the order's event", m.MessageId, m.Headers)
	}
}

// With OUTBOX_LISTEN_URL, a direct connection, the relay behind a
// transaction pooler is woken by the API's NOTIFYs (which pass through the
// pooler): with a poll interval of an hour, an order is still published.
func TestRelayBehindTransactionPoolerListensOnListenURL(t *testing.T) {
	t.Parallel()
	_, dbURL, direct := bouncedDatabase(t, pgbouncertest.Options{})
	amqpURL := newVhost(t)
	deliveries := bindQueue(t, amqpURL)
	relay, relayBase, apiBase := startBehindBouncer(t, dbURL, amqpURL, map[string]string{
		"RELAY_POLL_INTERVAL": "1h", "OUTBOX_LISTEN_URL": direct,
	})

	// Once the relay's LISTEN session is idle on the server, any later
	// NOTIFY reaches it.
	admin := pgtest.Connect(t)
	name := databaseName(t, direct)
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := admin.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
WHERE datname = $1 AND query LIKE 'LISTEN%' AND state = 'idle'`, name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the relay never listened\nlogs:\n%s", relay.logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	for range 3 {
		status, o := post(t, apiBase+"/orders", orderBody)
		if status != 201 {
			t.Fatalf("create: %d %v", status, o)
		}
		if m := receive(t, deliveries); m.Headers["aggregate_id"] != o["id"] {
			t.Fatalf("message %s %v, want the order's event", m.MessageId, m.Headers)
		}
	}
	waitMetrics(t, relayBase, "\noutbox_listen_fallback 0\n")
	if strings.Contains(relay.logs.String(), "falling back to polling") {
		t.Errorf("the relay fell back to polling with OUTBOX_LISTEN_URL:\n%s", relay.logs.String())
	}
}

// A relay started behind PgBouncer while PgBouncer's server is down does not
// reach PostgreSQL: PgBouncer takes its connection and answers it with an
// error of its own, query_wait_timeout or "server login has been failing"
// (SQLSTATE 08P01, protocol_violation, PgBouncer's code for all its errors).
// That is an outage like a refused connection: the relay waits, says so, and
// publishes once the server is back.
func TestRelayWaitsBehindPgBouncerWhoseServerIsDown(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	direct := migratedDatabaseURL(t)
	deliveries := bindQueue(t, amqpURL)

	// PgBouncer's server, through a listener that hangs up on every
	// connection until the server "comes up".
	gate, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = gate.Close() })
	u, err := url.Parse(direct)
	if err != nil {
		t.Fatal(err)
	}
	var up atomic.Bool
	go forward(gate, u.Host, &up)
	b := pgbouncertest.Start(t, pgbouncertest.Options{Server: gate.Addr().String(), QueryWaitTimeout: time.Second})
	p := start(t, map[string]string{
		"DATABASE_URL": b.URL(databaseName(t, direct), nil), "DATABASE_POOLER": "transaction",
		"AMQP_URL": amqpURL, "RELAY_POLL_INTERVAL": "50ms",
	}, "relay")

	// The relay meets PgBouncer's error, and keeps waiting.
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(p.logs.String(), "08P01") {
		select {
		case err := <-p.done:
			p.done <- err // for start's cleanup
			t.Fatalf("the relay exited while PgBouncer's server was down: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("the relay logged no PgBouncer error (SQLSTATE 08P01) in 30s\nlogs:\n%s\npgbouncer:\n%s", p.logs.String(), b.Logs())
		}
	}
	select {
	case err := <-p.done:
		p.done <- err
		t.Fatalf("the relay exited while PgBouncer's server was down: %v", err)
	case <-time.After(1500 * time.Millisecond):
	}
	if !strings.Contains(p.logs.String(), "waiting for the database") {
		t.Errorf("the relay did not say it waits for the database:\n%s", p.logs.String())
	}

	up.Store(true) // the server comes up
	pool := connectPool(t, direct)
	err = pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(t.Context(), tx, outbox.Message{
			AggregateType: "order", AggregateID: "o-bounced", EventType: "order.created", Payload: []byte(`{}`)})
	})
	if err != nil {
		t.Fatal(err)
	}
	if m := receive(t, deliveries); m.Headers["aggregate_id"] != "o-bounced" {
		t.Fatalf("published %v, want the event of o-bounced", m.Headers)
	}
}

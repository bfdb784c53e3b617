package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/e2e/chaos"
	"github.com/outbox-inbox/reference/internal/pgbouncertest"
)

// TestFlowThroughPgBouncer runs the orders API, two standalone relays and a
// shipping consumer with the orders side's DATABASE_URL through a PgBouncer
// of the test's own in pool_mode=transaction (DATABASE_POOLER=transaction).
// Relay 1 LISTENs on a direct connection (OUTBOX_LISTEN_URL), relay 2 has
// none and falls back to polling. While clients place orders, PgBouncer is
// restarted twice, and relay 1 and the API are killed (SIGKILL) and started
// again behind the same PgBouncer: the restart that failed before with
// "prepared statement "stmtcache_..." already exists". Every process must
// come back, and every committed order, acknowledged ones included, must be
// applied by shipping exactly once.
func TestFlowThroughPgBouncer(t *testing.T) {
	amqpHost := requireServices(t, true)
	bins := buildBinaries(t)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()

	id, runDir := newRunDir(t, "pgbouncer_")

	// The run's database, created directly (PgBouncer answers a missing
	// database with a generic protocol error, so `orders migrate` cannot
	// tell it apart and create it through PgBouncer).
	admin, err := pgx.Connect(ctx, testDatabaseURL())
	if err != nil {
		unavailable(t, "PostgreSQL unreachable at %s: %v", testDatabaseURL(), err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+id); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, testDatabaseURL())
		if err != nil {
			t.Errorf("cleanup: drop database %s: %v", id, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+id+" WITH (FORCE)"); err != nil {
			t.Errorf("cleanup: drop database %s: %v", id, err)
		}
	})
	direct := replaceDatabase(testDatabaseURL(), id)

	amqpURL := tempVhost(t, id, amqpHost)

	bouncer := pgbouncertest.Start(t, pgbouncertest.Options{PoolSize: 4})
	bounced := bouncer.URL(id, nil)

	var exitsMu sync.Mutex
	var exits []exitEvent
	onExit := func(ev exitEvent) {
		exitsMu.Lock()
		defer exitsMu.Unlock()
		exits = append(exits, ev)
	}
	mongo, err := startLocalMongo(ctx, bins.MongoLocal, runDir, onExit)
	if err != nil {
		t.Fatal(err)
	}
	procs := []*proc{}
	t.Cleanup(func() {
		for _, p := range procs {
			if err := p.close(); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
		if err := mongo.close(context.Background()); err != nil {
			t.Errorf("cleanup: stop MongoDB: %v", err)
		}
	})
	newProcess := func(spec procSpec) *proc {
		t.Helper()
		p, err := newProc(spec, runDir, onExit)
		if err != nil {
			t.Fatal(err)
		}
		procs = append(procs, p)
		return p
	}

	ordersEnv := []string{
		"DATABASE_URL=" + bounced, "DATABASE_POOLER=transaction", "AMQP_URL=" + amqpURL, "OUTBOX_NOTIFY=true",
		"RELAY_POLL_INTERVAL=200ms", "RELAY_BATCH_SIZE=100", "RELAY_MAX_ATTEMPTS=100000", "RELAY_LEASE=6s",
		"RELAY_BACKOFF_MIN=100ms", "RELAY_BACKOFF_MAX=2s", "LOG_LEVEL=info",
	}
	// Twice: the second run is a process started again behind the same
	// PgBouncer, after the first left its server connections behind.
	for i := range 2 {
		cmd := exec.CommandContext(ctx, bins.Orders, "migrate")
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, ordersEnv...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("orders migrate, run %d: %v\n%s", i+1, err, out)
		}
	}

	addrs := make([]string, 4)
	for i := range addrs {
		if addrs[i], err = freeAddr(); err != nil {
			t.Fatal(err)
		}
	}
	shipping := newProcess(procSpec{
		name: "shipping-1", bin: bins.Shipping,
		env:      []string{"AMQP_URL=" + amqpURL, "MONGO_URI=mongodb://" + mongo.addr() + "/" + id, "HTTP_ADDR=" + addrs[0], "LOG_LEVEL=info"},
		readyURL: "http://" + addrs[0] + "/readyz",
	})
	api := newProcess(procSpec{
		name: "orders", bin: bins.Orders,
		env:      append([]string{"HTTP_ADDR=" + addrs[1], "RELAY=false"}, ordersEnv...),
		readyURL: "http://" + addrs[1] + "/readyz",
	})
	relay1 := newProcess(procSpec{
		name: "relay-1", bin: bins.Orders, args: []string{"relay"},
		env:      append([]string{"HTTP_ADDR=" + addrs[2], "OUTBOX_LISTEN_URL=" + direct}, ordersEnv...),
		readyURL: "http://" + addrs[2] + "/readyz",
	})
	relay2 := newProcess(procSpec{
		name: "relay-2", bin: bins.Orders, args: []string{"relay"},
		env:      append([]string{"HTTP_ADDR=" + addrs[3]}, ordersEnv...),
		readyURL: "http://" + addrs[3] + "/readyz",
	})
	// Shipping first: it declares the queues the relays' publishes need.
	for _, p := range []*proc{shipping, api, relay1, relay2} {
		if _, err := p.start(); err != nil {
			t.Fatal(err)
		}
		if err := p.waitReady(ctx, time.Minute); err != nil {
			t.Fatal(err)
		}
	}

	rec := &chaos.Recorder{}
	w, err := chaos.NewWorkload(chaos.WorkloadConfig{
		BaseURL: "http://" + addrs[1], Recorder: rec, KeyPrefix: id, Clients: 3, Rate: 15,
		AttemptTimeout: 3 * time.Second, OpTimeout: 45 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	loadDone := make(chan struct{})
	go func() { defer close(loadDone); _ = w.Run(loadCtx) }()

	restart := func(p *proc) {
		t.Helper()
		p.kill()
		if _, err := p.start(); err != nil {
			t.Fatal(err)
		}
		if err := p.waitReady(ctx, time.Minute); err != nil {
			t.Fatalf("%v\n%s", err, tail(p.log.Name(), 20))
		}
		t.Logf("%s killed and started again", p.spec.name)
	}
	for _, step := range []func(){
		func() { bouncer.Restart(); t.Log("PgBouncer restarted") },
		func() { restart(relay1) },
		func() { restart(api) },
		func() { bouncer.Restart(); t.Log("PgBouncer restarted") },
		func() { restart(relay2) },
	} {
		sleep(ctx, 3*time.Second)
		step()
	}
	sleep(ctx, 3*time.Second)
	stopLoad()
	<-loadDone

	exitsMu.Lock()
	for _, ev := range exits {
		t.Errorf("%s #%d exited on its own (%s):\n%s", ev.proc, ev.incarnation, ev.status, ev.logTail)
	}
	exitsMu.Unlock()

	db, err := pgxpool.New(ctx, direct)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var acked []string
	for _, op := range rec.History().Ops {
		if op.Kind == chaos.OpCreate && op.Outcome == chaos.OutcomeOK {
			acked = append(acked, op.OrderID)
		}
	}
	if len(acked) == 0 {
		t.Fatal("no order was acknowledged")
	}

	// Wait until shipping applied every committed order, then check that it
	// applied each exactly once.
	var orders []chaos.CommittedOrder
	var shipments map[string]chaos.Shipment
	missing := func() []string {
		var out []string
		for _, o := range orders {
			if len(shipments[o.ID].Events) == 0 {
				out = append(out, o.ID)
			}
		}
		return out
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if orders, err = readOrders(ctx, db); err != nil {
			t.Fatal(err)
		}
		if shipments, err = readShipments(ctx, "mongodb://"+mongo.addr()+"/", id, shipmentsCollection); err != nil {
			t.Fatal(err)
		}
		m := missing()
		if len(m) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d committed orders never reached shipping, e.g. %v", len(m), len(orders), m[:min(len(m), 5)])
		}
		sleep(ctx, 500*time.Millisecond)
	}
	committed := map[string]bool{}
	for _, o := range orders {
		committed[o.ID] = true
		var created int
		for _, e := range shipments[o.ID].Events {
			if e.EventType == chaos.EventCreated {
				created++
			}
		}
		if created != 1 {
			t.Errorf("order %s: order.created applied %d times, want once: %+v", o.ID, created, shipments[o.ID].Events)
		}
	}
	for _, id := range acked {
		if !committed[id] {
			t.Errorf("acknowledged order %s is not in the database", id)
		}
	}
	t.Logf("%d orders acknowledged, %d committed, all applied once by shipping", len(acked), len(orders))
}

// userOf is the user name of an AMQP URL.
func userOf(t *testing.T, amqpURL string) string {
	t.Helper()
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	return u.User.Username()
}

// newRunDir names a run of a flow test (prefix and random hex, usable as a
// database and vhost name) and makes the directory its processes log to,
// removed after the test unless it failed.
func newRunDir(t *testing.T, prefix string) (id, dir string) {
	t.Helper()
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	id = prefix + hex.EncodeToString(b)
	dir, err := os.MkdirTemp("", id+"-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("process logs kept in %s", dir)
			return
		}
		_ = os.RemoveAll(dir)
	})
	return id, dir
}

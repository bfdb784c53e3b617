package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// clusterConfig sizes the system under test.
type clusterConfig struct {
	provider  string
	relays    int // standalone relays; the API runs without its in-process relay
	consumers int // shipping processes
	bins      Binaries
	// pgBinDir, when set, gives the run a PostgreSQL cluster of its own
	// (initdb, postgres from that directory, run as pgCred) instead of
	// TEST_DATABASE_URL's server, so that it can be restarted.
	pgBinDir string
	pgCred   *syscall.Credential
	// rabbitNodes, when set, gives the run a RabbitMQ cluster of its own of
	// that many nodes (rabbitCluster) instead of TEST_AMQP_URL's broker; the
	// services' AMQP_URL lists every node, each behind a proxy of its own.
	rabbitNodes int
	// rabbitNetns runs each of those nodes in a network namespace of its own
	// (nodeNet), for the partition fault.
	rabbitNetns bool
}

// cluster is one run's system: its own PostgreSQL database, RabbitMQ vhost
// and MongoDB database, toxiproxy in front of RabbitMQ (one proxy for the
// orders side, one for shipping) and MongoDB, and the service processes.
type cluster struct {
	t      testing.TB
	id     string // names the database, the vhost and the Mongo database
	runDir string // process logs and FerretDB's data

	pg        *ownPostgres // the run's own cluster, nil on the shared server; the primary after a failover
	standbys  []*ownPostgres
	pgNodes   int           // servers the run made besides the first, to name them
	dbURL     string        // the run's database, direct (the harness's reads)
	db        *pgxpool.Pool // harness connection to the run's database
	adminURL  string        // the server's maintenance database
	vhost     string
	amqpURL   string // the run's vhost, direct (poison publisher, queue checks)
	amqpAdmin string // TEST_AMQP_URL's host:port
	toxi      *toxi
	rabbit    *rabbitCluster // the run's own RabbitMQ cluster, nil on the machine's broker
	mongo     mongoServer
	mongoURI  string // through the proxy, as shipping sees it

	orders     *proc
	ordersURL  string
	ordersNext string // the orders binary of the next schema version (Binaries.OrdersNext)
	relays     []*proc
	shipping   []*proc
	shipURLs   []string
	procs      map[string]*proc

	// pgMu guards pg against a failover's promotion (the only writer
	// while faults run) for readers in steps that do not lock "postgres",
	// such as a pause's measures (directDB).
	pgMu sync.RWMutex

	mu      sync.Mutex
	exits   []exitEvent // exits nobody asked for (crash points included)
	brokerM sync.Mutex  // guards stopped; serialises stop_app and start_app
	stopped bool        // the broker app was stopped by a fault and not started since

	// deadPrimaries: what each postgres_failover's dead primary held, read
	// back; appended by the failover step, under the injector's "postgres"
	// lock, read by finalState once the plan is done.
	deadPrimaries []chaos.DeadPrimaryState

	// lastDeferrals is the drain's previous reading of shipping's deferral
	// counters, while the delay queue held messages (busy).
	lastDeferrals string
}

// Names of the toxiproxy proxies.
const (
	proxyMongo = chaos.TargetMongo
)

// newCluster builds and starts the system, registering its teardown with
// t.Cleanup: processes stopped, faults healed, broker app started if a fault
// left it stopped, database dropped, vhost deleted. Teardown runs whatever
// happened, so a failed run never leaves this machine's services down.
func newCluster(t *testing.T, cfg clusterConfig) *cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	b := make([]byte, 5)
	_, _ = rand.Read(b)
	c := &cluster{t: t, id: "chaos_" + hex.EncodeToString(b), procs: make(map[string]*proc), ordersNext: cfg.bins.OrdersNext}
	c.amqpAdmin = requireServices(t, cfg.pgBinDir == "")
	amqpU, err := url.Parse(testAMQPURL())
	if err != nil {
		t.Fatalf("TEST_AMQP_URL: %v", err)
	}

	runDir, err := os.MkdirTemp("", c.id+"-")
	if err != nil {
		t.Fatal(err)
	}
	c.runDir = runDir
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("CHAOS_KEEP_LOGS") == "true" {
			t.Logf("process logs kept in %s", runDir)
			return
		}
		_ = os.RemoveAll(runDir)
	})

	// PostgreSQL: the run's own cluster when it can have one, else the
	// shared server; a database of the run's own either way.
	c.adminURL = testDatabaseURL()
	if cfg.pgBinDir != "" {
		if c.pg, err = startOwnPostgres(ctx, cfg.pgBinDir, cfg.pgCred, c.onExit, runDir); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := c.pg.close(); err != nil {
				t.Errorf("cleanup: own PostgreSQL: %v", err)
			}
		})
		c.adminURL = c.pg.url("postgres")
	}
	c.dbURL = replaceDatabase(c.adminURL, c.id)

	// RabbitMQ: a vhost of the run's own, deleted in cleanup; on the run's
	// own cluster when it has one (stopped in cleanup), else on the
	// machine's broker.
	c.vhost = c.id
	user := amqpU.User.Username()
	brokers := []string{c.amqpAdmin}
	if cfg.rabbitNodes > 0 {
		startCtx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
		c.rabbit, err = startRabbitCluster(startCtx, c.id, runDir, cfg.rabbitNodes, cfg.rabbitNetns, c.onExit, t.Logf)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 2*time.Minute)
			defer cancel()
			if err := c.rabbit.close(ctx); err != nil {
				t.Errorf("cleanup: stop the RabbitMQ cluster: %v", err)
			}
		})
		brokers = c.rabbit.addrs()
	}
	if err := c.rabbitmqctl(ctx, "add_vhost", c.vhost); err != nil {
		t.Fatal(err)
	}
	if c.rabbit == nil {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), time.Minute)
			defer cancel()
			c.restoreBroker(ctx)
			if err := rabbitmqctl(ctx, "delete_vhost", c.vhost); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		})
	}
	if err := c.rabbitmqctl(ctx, "set_permissions", "-p", c.vhost, user, ".*", ".*", ".*"); err != nil {
		t.Fatal(err)
	}
	if c.amqpURL, err = withVhost(testAMQPURL(), brokers[0], c.vhost); err != nil {
		t.Fatal(err)
	}

	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), time.Minute)
		defer cancel()
		conn, err := pgx.Connect(ctx, c.adminURL)
		if err != nil {
			t.Errorf("cleanup: drop database %s: %v", c.id, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{c.id}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("cleanup: drop database %s: %v", c.id, err)
		}
	})

	// Toxiproxy between the services and RabbitMQ and MongoDB.
	c.toxi = newToxi()
	t.Cleanup(c.toxi.close)
	if c.pg != nil {
		if err := c.putPostgresBehindProxy(); err != nil {
			t.Fatal(err)
		}
	}
	// On a cluster, one proxy per side and node (amqp-orders@1 ...), and
	// the services' AMQP_URL lists the side's proxies.
	var ordersProxies, shippingProxies []string
	for i, broker := range brokers {
		for _, side := range []struct {
			name  string
			addrs *[]string
		}{{chaos.TargetAMQPOrders, &ordersProxies}, {chaos.TargetAMQPShipping, &shippingProxies}} {
			name := side.name
			if c.rabbit != nil {
				name = nodeProxy(side.name, i+1)
			}
			addr, err := c.toxi.add(name, broker)
			if err != nil {
				t.Fatal(err)
			}
			*side.addrs = append(*side.addrs, addr)
		}
	}
	ordersAMQP := strings.Join(ordersProxies, ",")

	// MongoDB.
	switch cfg.provider {
	case providerTestcontainers:
		c.mongo, err = startContainerMongo(ctx)
	default:
		c.mongo, err = startLocalMongo(ctx, cfg.bins.MongoLocal, runDir, c.onExit)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), time.Minute)
		defer cancel()
		if err := c.mongo.close(ctx); err != nil {
			t.Errorf("cleanup: stop MongoDB: %v", err)
		}
	})
	mongoProxy, err := c.toxi.add(proxyMongo, c.mongo.addr())
	if err != nil {
		t.Fatal(err)
	}
	c.mongoURI = "mongodb://" + mongoProxy + "/" + c.id + c.mongo.uriQuery()

	// Every process is stopped before the proxies, the vhost and the database
	// go (cleanups run last-registered first).
	t.Cleanup(func() {
		for name, p := range c.procs {
			if err := p.close(); err != nil {
				t.Errorf("cleanup: %s: %v", name, err)
			}
		}
		if c.db != nil {
			c.db.Close()
		}
	})

	if out, err := c.run(ctx, cfg.bins.Orders, c.ordersEnv(ordersAMQP, ""), "migrate"); err != nil {
		t.Fatalf("orders migrate: %v\n%s", err, out)
	}
	if c.db, err = pgxpool.New(ctx, c.dbURL); err != nil {
		t.Fatalf("connect to the run's database: %v", err)
	}

	// Shipping first: it declares its queues and bindings, so the relays'
	// mandatory publishes find a route.
	shipAMQP, err := c.amqpURLs(strings.Join(shippingProxies, ","))
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= cfg.consumers; i++ {
		addr, err := freeAddr()
		if err != nil {
			t.Fatal(err)
		}
		p := c.addProc(procSpec{
			name: chaos.ShippingName(i), bin: cfg.bins.Shipping,
			env: []string{
				"AMQP_URL=" + shipAMQP, "MONGO_URI=" + c.mongoURI, "HTTP_ADDR=" + addr, "LOG_LEVEL=info",
			},
			readyURL: "http://" + addr + "/readyz",
		})
		c.shipping = append(c.shipping, p)
		c.shipURLs = append(c.shipURLs, "http://"+addr)
	}
	// The API without its in-process relay (RELAY=false): the standalone
	// relays publish everything, so killing one of them is a relay fault and
	// killing the API is not. They wake on LISTEN/NOTIFY across processes.
	apiAddr, err := freeAddr()
	if err != nil {
		t.Fatal(err)
	}
	c.ordersURL = "http://" + apiAddr
	c.orders = c.addProc(procSpec{
		name: chaos.TargetOrders, bin: cfg.bins.Orders,
		env:      append(c.ordersEnv(ordersAMQP, apiAddr), "RELAY=false"),
		readyURL: c.ordersURL + "/readyz",
	})
	for i := 1; i <= cfg.relays; i++ {
		addr, err := freeAddr()
		if err != nil {
			t.Fatal(err)
		}
		dbURL, err := c.relayDatabaseURLFor(chaos.RelayName(i))
		if err != nil {
			t.Fatal(err)
		}
		c.relays = append(c.relays, c.addProc(procSpec{
			name: chaos.RelayName(i), bin: cfg.bins.Orders, args: []string{"relay"},
			env:      append(c.ordersEnv(ordersAMQP, addr), dbURL),
			readyURL: "http://" + addr + "/readyz",
		}))
	}
	for _, p := range append(append(append([]*proc{}, c.shipping...), c.orders), c.relays...) {
		if _, err := p.start(); err != nil {
			t.Fatal(err)
		}
		if err := p.waitReady(ctx, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// requireServices skips the test (fails it under CI=true) unless RabbitMQ,
// rabbitmqctl and (when the run uses it) the shared PostgreSQL are there,
// and returns RabbitMQ's host:port.
func requireServices(t *testing.T, sharedPostgres bool) string {
	t.Helper()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		unavailable(t, "rabbitmqctl not found: the chaos suite creates a vhost per run and injects broker faults with it")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if sharedPostgres {
		conn, err := pgx.Connect(ctx, testDatabaseURL())
		if err != nil {
			unavailable(t, "PostgreSQL unreachable at %s: %v (set TEST_DATABASE_URL)", testDatabaseURL(), err)
		}
		_ = conn.Close(ctx)
	}
	u, err := url.Parse(testAMQPURL())
	if err != nil {
		t.Fatalf("TEST_AMQP_URL: %v", err)
	}
	host := u.Host
	if _, _, err := net.SplitHostPort(host); err != nil {
		host = net.JoinHostPort(host, "5672")
	}
	amqpConn, err := net.DialTimeout("tcp", host, 5*time.Second)
	if err != nil {
		unavailable(t, "RabbitMQ unreachable at %s: %v (set TEST_AMQP_URL)", host, err)
	}
	_ = amqpConn.Close()
	return host
}

// ordersEnv is the environment of the orders API and the relays: short poll
// and backoff for fast drains, a short lease so a killed relay's rows come
// back quickly, and attempts high enough that no outage of a run
// dead-letters a row.
func (c *cluster) ordersEnv(amqpProxies, httpAddr string) []string {
	amqpURL, _ := c.amqpURLs(amqpProxies)
	env := []string{
		"DATABASE_URL=" + c.dbURL, "AMQP_URL=" + amqpURL, "OUTBOX_NOTIFY=true",
		"RELAY_POLL_INTERVAL=200ms", "RELAY_BATCH_SIZE=100", "RELAY_MAX_ATTEMPTS=100000", "RELAY_LEASE=6s",
		"RELAY_BACKOFF_MIN=100ms", "RELAY_BACKOFF_MAX=2s", "LOG_LEVEL=info",
	}
	env = append(env, relayModeEnv(c.id)...)
	if httpAddr != "" {
		env = append(env, "HTTP_ADDR="+httpAddr)
	}
	return env
}

// amqpURLs is the run's AMQP_URL through hosts, one host:port or several
// separated by commas (the nodes of a cluster): one URL per host, with the
// run's vhost, separated by commas.
func (c *cluster) amqpURLs(hosts string) (string, error) {
	var urls []string
	for h := range strings.SplitSeq(hosts, ",") {
		u, err := withVhost(testAMQPURL(), h, c.vhost)
		if err != nil {
			return "", err
		}
		urls = append(urls, u)
	}
	return strings.Join(urls, ","), nil
}

// nodeProxy names the proxy of one side (chaos.TargetAMQPOrders or
// TargetAMQPShipping) to the i-th node of the run's cluster.
func nodeProxy(side string, i int) string { return side + "@" + strconv.Itoa(i) }

// proxies are the proxies a broker proxy fault on target acts on: the target
// itself on the machine's broker, the side's proxy to every node on a
// cluster (the side loses the whole broker).
func (c *cluster) proxies(target string) []string {
	if c.rabbit == nil {
		return []string{target}
	}
	var out []string
	for i := range c.rabbit.nodes {
		out = append(out, nodeProxy(target, i+1))
	}
	return out
}

// rabbitmqctl runs rabbitmqctl against the run's broker: a node of its own
// cluster that answers, or the machine's broker.
func (c *cluster) rabbitmqctl(ctx context.Context, args ...string) error {
	_, err := c.ctl(ctx, args...)
	return err
}

// ctl is rabbitmqctl against the run's broker, returning what it printed.
func (c *cluster) ctl(ctx context.Context, args ...string) (string, error) {
	if c.rabbit != nil {
		return c.rabbit.ctl(ctx, args...)
	}
	return rabbitmqctlOutput(ctx, args...)
}

func (c *cluster) addProc(spec procSpec) *proc {
	c.t.Helper()
	p, err := newProc(spec, c.runDir, c.onExit)
	if err != nil {
		c.t.Fatal(err)
	}
	c.procs[spec.name] = p
	return p
}

// onExit records an exit the harness did not ask for.
func (c *cluster) onExit(ev exitEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.exits = append(c.exits, ev)
	if ev.crashPoint == "" {
		c.t.Logf("unexpected exit of %s #%d: %s (restarting it)", ev.proc, ev.incarnation, ev.status)
	}
}

// unexpectedExits are the exits that were no crash point.
func (c *cluster) unexpectedExits() []exitEvent {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []exitEvent
	for _, ev := range c.exits {
		if ev.crashPoint == "" {
			out = append(out, ev)
		}
	}
	return out
}

// run runs a binary to completion with env.
func (c *cluster) run(ctx context.Context, bin string, env []string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// ensureAllRunning starts every process that is down (after the faults).
func (c *cluster) ensureAllRunning(ctx context.Context) error {
	var errs []error
	if c.pg != nil {
		if err := c.pg.start(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.mongo.start(ctx); err != nil {
		errs = append(errs, err)
	}
	if c.rabbit != nil {
		if err := c.rabbit.heal(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	for _, p := range c.procs {
		if err := p.ensureRunning(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, p := range c.procs {
		if err := p.waitReady(ctx, time.Minute); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// restoreBroker starts the broker app if a fault left it stopped.
func (c *cluster) restoreBroker(ctx context.Context) {
	c.brokerM.Lock()
	defer c.brokerM.Unlock()
	if !c.stopped {
		return
	}
	if err := startBrokerApp(ctx); err != nil {
		c.t.Errorf("RESTORE FAILED, the broker app may still be stopped (run `rabbitmqctl start_app`): %v", err)
		return
	}
	c.stopped = false
}

func startBrokerApp(ctx context.Context) error {
	if err := rabbitmqctl(ctx, "start_app"); err != nil {
		return err
	}
	return rabbitmqctl(ctx, "await_startup", "--timeout", "60")
}

// rabbitmqctl runs the machine broker's rabbitmqctl with args.
func rabbitmqctl(ctx context.Context, args ...string) error {
	_, err := rabbitmqctlOutput(ctx, args...)
	return err
}

// rabbitmqctlOutput runs the machine broker's rabbitmqctl with args and
// returns its standard output.
func rabbitmqctlOutput(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "rabbitmqctl", append([]string{"-q"}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()+stdout.String()))
	}
	return stdout.String(), nil
}

func replaceDatabase(databaseURL, db string) string {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return databaseURL
	}
	u.Path = "/" + db
	return u.String()
}

func freeAddr() (string, error) {
	port, err := freePort()
	if err != nil {
		return "", err
	}
	return net.JoinHostPort("127.0.0.1", port), nil
}

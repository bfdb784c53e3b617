package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/mongodb"
)

// Provider names, printed at the start of a run and written in the report.
const (
	providerLocal          = "local processes + embedded FerretDB"
	providerTestcontainers = "testcontainers"
)

// mongoServer is the MongoDB the shipping consumers use, behind toxiproxy.
type mongoServer interface {
	// addr is the server's address, the proxy's upstream. It changes when a
	// restart moves the server to another port.
	addr() string
	// uriQuery is what a client's MONGO_URI needs after the database name,
	// e.g. "?directConnection=true" to reach a replica set through a proxy.
	uriQuery() string
	// stop kills the server; start brings it back with the same data.
	stop(ctx context.Context) error
	start(ctx context.Context) error
	close(ctx context.Context) error
}

// chooseProvider returns the provider from CHAOS_PROVIDER ("local",
// "testcontainers", or "auto", the default: testcontainers when a Docker
// engine answers, else local processes).
func chooseProvider(ctx context.Context) (string, error) {
	switch p := os.Getenv("CHAOS_PROVIDER"); p {
	case "local":
		return providerLocal, nil
	case "testcontainers":
		return providerTestcontainers, nil
	case "", "auto":
		if dockerAvailable(ctx) {
			return providerTestcontainers, nil
		}
		return providerLocal, nil
	default:
		return "", fmt.Errorf("CHAOS_PROVIDER=%q: want local, testcontainers or auto", p)
	}
}

// dockerAvailable tells whether a Docker engine answers within a few
// seconds. Without a socket or DOCKER_HOST it answers at once, without
// loading testcontainers' configuration.
func dockerAvailable(ctx context.Context) bool {
	if os.Getenv("DOCKER_HOST") == "" {
		if _, err := os.Stat("/var/run/docker.sock"); err != nil {
			return false
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return false
	}
	defer cli.Close()
	_, err = cli.Ping(ctx)
	return err == nil
}

// localMongo is cmd/mongolocal (embedded FerretDB, SQLite backend) run as a
// process, so a fault can kill it and start it again on the same port and
// data directory.
type localMongo struct {
	p    *proc
	port string
	disk string // the filesystem of its own its data moved to (mongo_disk_full), unmounted by close
}

func startLocalMongo(ctx context.Context, bin, runDir string, onExit func(exitEvent)) (*localMongo, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", port)
	p, err := newProc(procSpec{
		name: "mongolocal",
		bin:  bin,
		args: []string{"-addr", addr, "-data-dir", filepath.Join(runDir, "mongo-data")},
	}, runDir, onExit)
	if err != nil {
		return nil, err
	}
	m := &localMongo{p: p, port: port}
	if err := m.start(ctx); err != nil {
		_ = p.close()
		return nil, err
	}
	return m, nil
}

func (m *localMongo) addr() string     { return net.JoinHostPort("127.0.0.1", m.port) }
func (m *localMongo) uriQuery() string { return "" }

func (m *localMongo) stop(context.Context) error {
	m.p.kill()
	return nil
}

func (m *localMongo) start(ctx context.Context) error {
	if err := m.p.ensureRunning(); err != nil {
		return err
	}
	return waitTCP(ctx, m.addr(), 30*time.Second)
}

func (m *localMongo) close(context.Context) error { return errors.Join(m.p.close(), unmount(m.disk)) }

// containerMongo is a single-node MongoDB replica set in a container: the
// inbox runs in its transaction mode there.
type containerMongo struct {
	c    *mongodb.MongoDBContainer
	host string
}

func startContainerMongo(ctx context.Context) (*containerMongo, error) {
	c, err := mongodb.Run(ctx, "mongo:7", mongodb.WithReplicaSet("rs0"))
	if err != nil {
		if c != nil {
			_ = testcontainers.TerminateContainer(c)
		}
		return nil, fmt.Errorf("start MongoDB container: %w", err)
	}
	m := &containerMongo{c: c}
	if err := m.refresh(ctx); err != nil {
		_ = testcontainers.TerminateContainer(c)
		return nil, err
	}
	return m, nil
}

func (m *containerMongo) refresh(ctx context.Context) error {
	ep, err := m.c.PortEndpoint(ctx, "27017/tcp", "")
	if err != nil {
		return fmt.Errorf("MongoDB container endpoint: %w", err)
	}
	m.host = ep
	return nil
}

func (m *containerMongo) addr() string { return m.host }

// The replica set names its member by the container's address, which the
// services cannot reach through the proxy: connect directly to the node.
func (m *containerMongo) uriQuery() string { return "?directConnection=true" }

func (m *containerMongo) stop(ctx context.Context) error {
	timeout := time.Duration(0) // SIGKILL at once, like a crash
	if err := m.c.Stop(ctx, &timeout); err != nil {
		return fmt.Errorf("stop MongoDB container: %w", err)
	}
	return nil
}

func (m *containerMongo) start(ctx context.Context) error {
	if err := m.c.Start(ctx); err != nil {
		return fmt.Errorf("start MongoDB container: %w", err)
	}
	if err := m.refresh(ctx); err != nil {
		return err
	}
	return waitTCP(ctx, m.host, time.Minute)
}

func (m *containerMongo) close(context.Context) error {
	return testcontainers.TerminateContainer(m.c)
}

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return port, nil
}

// waitTCP waits until addr accepts connections.
func waitTCP(ctx context.Context, addr string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			return conn.Close()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s does not accept connections after %v: %w", addr, timeout, errors.Join(err, ctx.Err()))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

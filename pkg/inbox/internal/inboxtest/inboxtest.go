// Package inboxtest gives the inbox's tests their MongoDB servers, using
// nothing outside the inbox's own directory tree, so the package can be
// copied into another module together with its tests.
//
// Database returns a fresh database on TEST_MONGO_URI when it is set, else on
// a FerretDB (MongoDB wire protocol over SQLite) embedded in the test binary,
// started on first use. ReplicaSet returns one on a MongoDB replica set, for
// the transaction-mode tests: TEST_MONGO_REPLSET_URI, or a single-node
// replica set started in a container through testcontainers when a Docker
// engine answers. Without either, those tests are skipped with the reason,
// also under CI=true (a machine without Docker cannot have a replica set; any
// other failure to get one fails under CI=true), and Suite prints how many
// were skipped and why after the run.
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(inboxtest.Suite(m)) }
package inboxtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/FerretDB/FerretDB/ferretdb"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/mongodb"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// ReplicaSetImage is the MongoDB image of the testcontainers replica set.
const ReplicaSetImage = "mongo:7.0"

// servers are the test binary's shared servers, started on first use and
// stopped by Suite's Run: test support, one per process by design.
var servers struct {
	mu sync.Mutex

	ferret     *ferretServer
	ferretErr  error
	replset    *mongodb.MongoDBContainer
	replsetURI string
	replsetErr error
	noReplset  string // non-empty: no replica set can be had here, and why

	skipped    []string // tests skipped for want of a replica set
	skipReason string
}

// Runner is what goleak.VerifyTestMain and os.Exit-style TestMains need.
type Runner interface{ Run() int }

type suite struct {
	m   *testing.M
	out io.Writer
}

// Suite wraps m: its Run runs the tests, stops the servers it started, and
// prints one line saying how many transaction-mode tests did not run and why
// (go test shows it with -v or when the package fails).
func Suite(m *testing.M) Runner { return suite{m: m, out: os.Stdout} }

func (s suite) Run() int {
	code := s.m.Run()
	servers.mu.Lock()
	defer servers.mu.Unlock()
	if n := len(servers.skipped); n > 0 {
		slices.Sort(servers.skipped)
		fmt.Fprintf(s.out, "inboxtest: %d transaction-mode tests did not run: %s: %s\n",
			n, servers.skipReason, strings.Join(servers.skipped, ", "))
	}
	if servers.ferret != nil {
		if err := servers.ferret.close(); err != nil {
			fmt.Fprintf(os.Stderr, "inboxtest: stop embedded FerretDB: %v\n", err)
			code = max(code, 1)
		}
		servers.ferret = nil
	}
	if servers.replset != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := testcontainers.TerminateContainer(servers.replset, testcontainers.StopContext(ctx)); err != nil {
			fmt.Fprintf(os.Stderr, "inboxtest: terminate container: %v\n", err)
			code = max(code, 1)
		}
		servers.replset = nil
	}
	return code
}

// URI returns the connection string of the server Database uses.
func URI(t testing.TB) string {
	t.Helper()
	uri, err := SharedURI()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("inboxtest: %v (required under CI=true)", err)
		}
		t.Skipf("inboxtest: %v", err)
	}
	return uri
}

// SharedURI is URI for examples, which have no testing.TB: the embedded
// FerretDB's error is returned instead of skipping.
func SharedURI() (string, error) {
	if uri := os.Getenv("TEST_MONGO_URI"); uri != "" {
		return uri, nil
	}
	servers.mu.Lock()
	defer servers.mu.Unlock()
	if servers.ferret == nil && servers.ferretErr == nil {
		servers.ferret, servers.ferretErr = startFerret()
	}
	if servers.ferretErr != nil {
		return "", fmt.Errorf("embedded FerretDB did not start: %w", servers.ferretErr)
	}
	return servers.ferret.uri, nil
}

// Database returns a fresh database on TEST_MONGO_URI or the embedded
// FerretDB, on a connected client; the database is dropped and the client
// disconnected when the test ends.
func Database(t testing.TB) *mongo.Database {
	t.Helper()
	return connect(t, URI(t))
}

// ReplicaSetURI returns the replica set's connection string, or skips t
// (recording why, for Suite's summary) when none can be had.
func ReplicaSetURI(t testing.TB) string {
	t.Helper()
	if uri := os.Getenv("TEST_MONGO_REPLSET_URI"); uri != "" {
		return uri
	}
	servers.mu.Lock()
	defer servers.mu.Unlock()
	if servers.replsetURI == "" && servers.noReplset == "" && servers.replsetErr == nil {
		servers.replsetURI, servers.noReplset, servers.replsetErr = startReplicaSet(context.WithoutCancel(t.Context()))
	}
	switch {
	case servers.noReplset != "":
		servers.skipped = append(servers.skipped, t.Name())
		servers.skipReason = fmt.Sprintf("no replica set: TEST_MONGO_REPLSET_URI is unset and Docker is absent (%s)", servers.noReplset)
		t.Skipf("inboxtest: %s", servers.skipReason)
	case servers.replsetErr != nil && os.Getenv("CI") == "true":
		t.Fatalf("inboxtest: start a MongoDB replica set container: %v (required under CI=true)", servers.replsetErr)
	case servers.replsetErr != nil:
		servers.skipped = append(servers.skipped, t.Name())
		servers.skipReason = fmt.Sprintf("no replica set: the container did not start: %v", servers.replsetErr)
		t.Skipf("inboxtest: %s", servers.skipReason)
	}
	return servers.replsetURI
}

// ReplicaSet returns a fresh database on the replica set (see ReplicaSetURI).
func ReplicaSet(t testing.TB) *mongo.Database {
	t.Helper()
	return connect(t, ReplicaSetURI(t))
}

// Client returns a new client of uri, disconnected when the test ends.
func Client(t testing.TB, uri string) *mongo.Client {
	t.Helper()
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(15 * time.Second))
	if err != nil {
		t.Fatalf("inboxtest: connect %s: %v", uri, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 30*time.Second)
		defer cancel()
		if err := client.Disconnect(ctx); err != nil {
			t.Errorf("inboxtest: disconnect: %v", err)
		}
	})
	return client
}

func connect(t testing.TB, uri string) *mongo.Database {
	t.Helper()
	client := Client(t, uri)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := client.Ping(ctx, nil); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("inboxtest: MongoDB unreachable at %s: %v (required under CI=true)", uri, err)
		}
		t.Skipf("inboxtest: MongoDB unreachable at %s: %v", uri, err)
	}
	db := client.Database(DatabaseName(t))
	t.Cleanup(func() { // runs before the client's disconnect
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 30*time.Second)
		defer cancel()
		if err := db.Drop(ctx); err != nil {
			t.Errorf("inboxtest: drop database %s: %v", db.Name(), err)
		}
	})
	return db
}

// DatabaseName returns a database name unique to this call, readable in logs
// and within FerretDB's limits ([a-zA-Z0-9_-], at most 63 bytes).
func DatabaseName(t testing.TB) string {
	t.Helper()
	var b strings.Builder
	for _, r := range t.Name() {
		if b.Len() >= 40 {
			break
		}
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	suffix := make([]byte, 6)
	_, _ = rand.Read(suffix)
	return "t_" + b.String() + "_" + hex.EncodeToString(suffix)
}

// ferretServer is an embedded FerretDB with its SQLite files in a temporary
// directory.
type ferretServer struct {
	uri    string
	dir    string
	cancel context.CancelFunc
	done   chan struct{}
}

func startFerret() (*ferretServer, error) {
	dir, err := os.MkdirTemp("", "inboxtest-")
	if err != nil {
		return nil, err
	}
	// Bind a free port first: ferretdb.New leaks its backend when its own
	// listener fails.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	addr := l.Addr().String()
	_ = l.Close()
	f, err := ferretdb.New(&ferretdb.Config{
		Listener: ferretdb.ListenerConfig{TCP: addr},
		// FerretDB logs every failed command at WARN, and duplicate keys are
		// the inbox's normal path.
		Logger:    slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
		Handler:   "sqlite",
		SQLiteURL: "file:" + dir + "/",
	})
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &ferretServer{uri: f.MongoDBURI(), dir: dir, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		_ = f.Run(ctx)
	}()
	return s, nil
}

func (s *ferretServer) close() error {
	s.cancel()
	<-s.done
	return os.RemoveAll(s.dir)
}

// startReplicaSet returns the container's URI, or why no Docker engine can
// be used.
func startReplicaSet(ctx context.Context) (uri, absent string, err error) {
	if reason := dockerAbsent(ctx); reason != "" {
		return "", reason, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	c, err := mongodb.Run(ctx, ReplicaSetImage, mongodb.WithReplicaSet("rs0"))
	if c != nil {
		servers.replset = c
	}
	if err != nil {
		return "", "", fmt.Errorf("run %s: %w", ReplicaSetImage, err)
	}
	cs, err := c.ConnectionString(ctx)
	if err != nil {
		return "", "", fmt.Errorf("connection string: %w", err)
	}
	// The member advertises the container's host name; talk to it directly.
	u, err := url.Parse(cs)
	if err != nil {
		return "", "", fmt.Errorf("parse %q: %w", cs, err)
	}
	q := u.Query()
	q.Set("directConnection", "true")
	u.RawQuery = q.Encode()
	return u.String(), "", nil
}

// dockerAbsent returns why no Docker engine can be used, or "".
func dockerAbsent(ctx context.Context) (reason string) {
	defer func() {
		if r := recover(); r != nil { // testcontainers panics on some setups without Docker
			reason = fmt.Sprint(r)
		}
	}()
	p, err := testcontainers.ProviderDocker.GetProvider()
	if err != nil {
		return err.Error()
	}
	defer p.Close()
	hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := p.Health(hctx); err != nil {
		return err.Error()
	}
	return ""
}

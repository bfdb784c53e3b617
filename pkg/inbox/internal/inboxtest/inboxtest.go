// Package inboxtest gives the inbox's tests their MongoDB servers. It
// imports the MongoDB driver and nothing else outside the standard library,
// so that a copy of pkg/inbox, tests included, adds no server, container
// library or embedded database to the copier's go.mod.
//
// Database returns a fresh database on TEST_MONGO_URI (a standalone mongod,
// or FerretDB). ReplicaSet returns one on TEST_MONGO_REPLSET_URI (a replica
// set), for the transaction-mode tests. When one is unset and the tests run
// inside the reference repository (the module around them has
// internal/mongolocal/testserver), that command serves the server instead:
// an embedded FerretDB, or a single-node replica set in a container when a
// Docker engine answers, for as long as the test binary runs. Without a
// server, tests skip with the reason, or fail under CI=true; for want of a
// replica set they skip also under CI=true (a machine without Docker cannot
// have one), and Suite prints how many did not run and why.
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(inboxtest.Suite(m)) }
package inboxtest

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// testServer is the command of the reference repository that serves a
// server to these tests, relative to its module root.
const testServer = "internal/mongolocal/testserver"

// servers are the test binary's servers, started on first use and stopped
// by Suite's Run: test support, one per process by design.
var servers struct {
	mu         sync.Mutex
	standalone *server
	replset    *server

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
	for _, srv := range []*server{servers.standalone, servers.replset} {
		if err := srv.close(); err != nil {
			fmt.Fprintf(os.Stderr, "inboxtest: %v\n", err)
			code = max(code, 1)
		}
	}
	servers.standalone, servers.replset = nil, nil
	return code
}

// URI returns the connection string of the server Database uses:
// TEST_MONGO_URI, or the repository's test server.
func URI(t testing.TB) string {
	t.Helper()
	uri, err := SharedURI()
	if err != nil {
		unavailable(t, "%v", err)
	}
	return uri
}

// SharedURI is URI for code without a testing.TB (examples): an error says
// why there is no server.
func SharedURI() (string, error) {
	if uri := os.Getenv("TEST_MONGO_URI"); uri != "" {
		return uri, nil
	}
	servers.mu.Lock()
	defer servers.mu.Unlock()
	if servers.standalone == nil {
		servers.standalone = startServer("standalone")
	}
	srv := servers.standalone
	switch {
	case srv.err != nil:
		return "", fmt.Errorf("no MongoDB for the tests: %w", srv.err)
	case srv.absent != "":
		return "", errors.New("no MongoDB for the tests: " + srv.absent)
	}
	return srv.uri, nil
}

// Database returns a fresh database on TEST_MONGO_URI or the repository's
// test server, on a connected client; the database is dropped and the
// client disconnected when the test ends.
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
	if servers.replset == nil {
		servers.replset = startServer("replset")
	}
	srv := servers.replset
	switch {
	case srv.err != nil && os.Getenv("CI") == "true":
		t.Fatalf("inboxtest: start a MongoDB replica set: %v (required under CI=true)", srv.err)
	case srv.err != nil:
		servers.skipped = append(servers.skipped, t.Name())
		servers.skipReason = fmt.Sprintf("no replica set: %v", srv.err)
		t.Skipf("inboxtest: %s", servers.skipReason)
	case srv.absent != "":
		servers.skipped = append(servers.skipped, t.Name())
		servers.skipReason = "no replica set: TEST_MONGO_REPLSET_URI is unset and " + srv.absent
		t.Skipf("inboxtest: %s", servers.skipReason)
	}
	return srv.uri
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
		unavailable(t, "MongoDB unreachable at %s: %v", uri, err)
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

// unavailable skips t, or fails it under CI=true.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("inboxtest: "+format+" (required under CI=true)", args...)
	}
	t.Skipf("inboxtest: "+format, args...)
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
	return "t_" + b.String() + "_" + RandomSuffix()
}

// RandomSuffix is 12 random hex digits, to make a name of one's own.
func RandomSuffix() string {
	suffix := make([]byte, 6)
	_, _ = rand.Read(suffix)
	return hex.EncodeToString(suffix)
}

// server is one run of the repository's test server, or why there is none.
type server struct {
	uri    string
	absent string // no server here, and why
	err    error  // the server could not be started

	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan struct{} // closed once cmd has exited
}

// startServer runs the repository's test server for kind ("standalone" or
// "replset") and waits for its first line.
func startServer(kind string) *server {
	root, err := moduleRoot()
	if err != nil {
		return &server{err: err}
	}
	if _, err := os.Stat(filepath.Join(root, filepath.FromSlash(testServer), "main.go")); err != nil {
		env := "TEST_MONGO_URI"
		if kind == "replset" {
			env = "TEST_MONGO_REPLSET_URI"
		}
		return &server{absent: "set " + env + " (the module around the tests has no " + testServer + " to serve one)"}
	}
	// "go run" keeps the built command in the build cache; the server
	// stops when its standard input ends, that is, with this process.
	cmd := exec.Command("go", "run", "./"+testServer, kind)
	cmd.Dir = root
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return &server{err: err}
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return &server{err: err}
	}
	if err := cmd.Start(); err != nil {
		return &server{err: fmt.Errorf("go run ./%s: %w", testServer, err)}
	}
	s := &server{cmd: cmd, stdin: stdin, done: make(chan struct{})}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait()
		close(s.done)
	}()
	// The first run builds the command: minutes on a loaded machine.
	timer := time.NewTimer(10 * time.Minute)
	defer timer.Stop()
	var line string
	select {
	case line = <-lines:
	case <-timer.C:
		s.err = fmt.Errorf("go run ./%s %s: no answer within 10 minutes", testServer, kind)
		_ = s.close()
		return s
	}
	switch k, v, _ := strings.Cut(line, "="); k {
	case "uri":
		s.uri = v
	case "absent":
		s.absent = v
	case "error":
		s.err = errors.New(v)
	default:
		s.err = fmt.Errorf("go run ./%s %s: unexpected answer %q (see its output above)", testServer, kind, line)
	}
	return s
}

// close stops the server: its standard input ends, and it exits.
func (s *server) close() error {
	if s == nil || s.cmd == nil {
		return nil
	}
	_ = s.stdin.Close()
	select {
	case <-s.done:
		return nil
	case <-time.After(time.Minute):
		_ = s.cmd.Process.Kill()
		<-s.done
		return fmt.Errorf("test server %s did not stop within a minute after its input closed: killed", strings.Join(s.cmd.Args, " "))
	}
}

// moduleRoot returns the directory of the module holding the tests.
func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("the tests run outside a module")
	}
	return filepath.Dir(gomod), nil
}

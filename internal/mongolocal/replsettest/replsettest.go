// Package replsettest gives tests a database on a MongoDB replica set, where
// multi-document transactions work (the embedded FerretDB has none).
//
// The replica set is TEST_MONGO_REPLSET_URI when set; otherwise a single-node
// replica set in a container started through testcontainers, once per test
// binary, when a Docker engine answers. Without either, tests are skipped with
// the reason, also under CI=true: a machine without Docker cannot have one,
// and this is the only skip CI accepts. Any other failure fails the test under CI=true.
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(replsettest.Suite(m)) }
package replsettest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/mongodb"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
)

// Image is the MongoDB image the container runs.
const Image = "mongo:7.0"

// shared is the test binary's container, started on first use and
// terminated by Suite's Run.
var shared struct {
	mu   sync.Mutex
	stop func(context.Context) error // terminates the container; nil: none started
	uri  string
	skip string // non-empty: no Docker engine, the reason
	err  error

	skipped    []string // tests skipped for want of a replica set
	skipReason string
}

// Runner is what goleak.VerifyTestMain and os.Exit-style TestMains need.
type Runner interface{ Run() int }

type suite struct{ r mongotest.Runner }

// Suite wraps m: its Run runs the tests (through mongotest.Suite, so the
// embedded FerretDB stops too), prints one line saying how many tests were
// skipped for want of a replica set and why (go test shows it with -v or
// when the package fails), then terminates the container, if one was
// started.
func Suite(m *testing.M) Runner { return suite{r: mongotest.Suite(m)} }

func (s suite) Run() int {
	code := s.r.Run()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if n := len(shared.skipped); n > 0 {
		slices.Sort(shared.skipped)
		fmt.Printf("replsettest: %d transaction-mode tests did not run: %s: %s\n",
			n, shared.skipReason, strings.Join(shared.skipped, ", "))
	}
	if shared.stop != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := shared.stop(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "replsettest: %v\n", err)
			code = max(code, 1)
		}
		shared.stop = nil
	}
	return code
}

// URI returns the replica set's connection string, skipping the test when
// neither TEST_MONGO_REPLSET_URI nor a Docker engine is there.
func URI(t testing.TB) string {
	t.Helper()
	if uri := os.Getenv("TEST_MONGO_REPLSET_URI"); uri != "" {
		return uri
	}
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.uri == "" && shared.skip == "" && shared.err == nil {
		shared.uri, shared.skip, shared.stop, shared.err = Start(context.WithoutCancel(t.Context()))
	}
	switch {
	case shared.skip != "":
		shared.skipReason = fmt.Sprintf("no replica set: Docker is absent (%s) and TEST_MONGO_REPLSET_URI is unset", shared.skip)
		shared.skipped = append(shared.skipped, t.Name())
		t.Skipf("replsettest: %s", shared.skipReason)
	case shared.err != nil && os.Getenv("CI") == "true":
		t.Fatalf("replsettest: start a MongoDB replica set container: %v (required under CI=true)", shared.err)
	case shared.err != nil:
		shared.skipReason = fmt.Sprintf("no replica set: the container did not start: %v", shared.err)
		shared.skipped = append(shared.skipped, t.Name())
		t.Skipf("replsettest: %s", shared.skipReason)
	}
	return shared.uri
}

// Start starts a single-node replica set in a container and returns its
// connection string and a function that terminates the container (call it
// even when err is set: a container may have started). absent says why no
// Docker engine can be used; then nothing was started.
func Start(ctx context.Context) (uri, absent string, stop func(context.Context) error, err error) {
	if reason := dockerAbsent(ctx); reason != "" {
		return "", reason, nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	c, err := mongodb.Run(ctx, Image, mongodb.WithReplicaSet("rs0"))
	if c != nil {
		stop = func(ctx context.Context) error {
			if err := testcontainers.TerminateContainer(c, testcontainers.StopContext(ctx)); err != nil {
				return fmt.Errorf("terminate container: %w", err)
			}
			return nil
		}
	}
	if err != nil {
		return "", "", stop, fmt.Errorf("run %s: %w", Image, err)
	}
	cs, err := c.ConnectionString(ctx)
	if err != nil {
		return "", "", stop, fmt.Errorf("connection string: %w", err)
	}
	// The member advertises the container's host name; talk to it directly.
	u, err := url.Parse(cs)
	if err != nil {
		return "", "", stop, fmt.Errorf("parse %q: %w", cs, err)
	}
	q := u.Query()
	q.Set("directConnection", "true")
	u.RawQuery = q.Encode()
	return u.String(), "", stop, nil
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

// Database returns a fresh database on the replica set, on a connected
// client; the database is dropped and the client disconnected when the test
// ends.
func Database(t testing.TB) *mongo.Database {
	t.Helper()
	uri := URI(t)
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(15 * time.Second))
	if err != nil {
		t.Fatalf("replsettest: connect %s: %v", uri, err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := client.Ping(ctx, nil); err != nil {
		_ = client.Disconnect(context.WithoutCancel(ctx))
		t.Fatalf("replsettest: replica set unreachable at %s: %v", uri, err)
	}
	db := client.Database(mongotest.DatabaseName(t))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 30*time.Second)
		defer cancel()
		if err := db.Drop(ctx); err != nil {
			t.Errorf("replsettest: drop database %s: %v", db.Name(), err)
		}
		if err := client.Disconnect(ctx); err != nil {
			t.Errorf("replsettest: disconnect: %v", err)
		}
	})
	return db
}

// Package mongotest gives tests a MongoDB database of their own.
//
// By default the database lives on one embedded FerretDB per test binary (see
// package mongolocal), started on first use; each test gets a fresh database
// on it, dropped when the test ends, so tests run in parallel. Set
// TEST_MONGO_URI to run the same tests against an external MongoDB instead.
//
// A package whose tests use it wraps its TestMain so the shared server stops
// before goleak looks for leaked goroutines:
//
//	func TestMain(m *testing.M) { goleak.VerifyTestMain(mongotest.Suite(m)) }
package mongotest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/event"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal"
)

// shared is the test binary's embedded server, started on first use and
// stopped by Suite's Run. It is test support: one per process by design.
var shared struct {
	mu  sync.Mutex
	srv *mongolocal.Server
	err error
}

// Runner is what goleak.VerifyTestMain and os.Exit-style TestMains need.
type Runner interface{ Run() int }

type suite struct{ m *testing.M }

// Suite wraps m: its Run runs the tests, then stops the shared embedded
// server, if one was started.
func Suite(m *testing.M) Runner { return suite{m: m} }

func (s suite) Run() int {
	code := s.m.Run()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.srv != nil {
		if err := shared.srv.Close(); err != nil {
			fmt.Fprintf(os.Stderr, "mongotest: stop embedded FerretDB: %v\n", err)
			code = max(code, 1)
		}
		shared.srv = nil
	}
	return code
}

// URI returns the connection string of the server tests use: TEST_MONGO_URI
// when set, else the shared embedded FerretDB (started now if needed). A
// server that cannot be had skips the test, or fails it under CI=true.
func URI(t testing.TB) string {
	t.Helper()
	if uri := os.Getenv("TEST_MONGO_URI"); uri != "" {
		return uri
	}
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.srv == nil && shared.err == nil {
		// The server outlives the test that happened to start it; Suite stops it.
		shared.srv, shared.err = mongolocal.Start(context.WithoutCancel(t.Context()), mongolocal.Config{})
	}
	if shared.err != nil {
		unavailable(t, "embedded FerretDB did not start: %v", shared.err)
	}
	return shared.srv.URI()
}

// ForTest returns the server's URI and the name of a database no other test
// uses. The database is dropped when the test ends.
func ForTest(t testing.TB) (uri, database string) {
	t.Helper()
	db := Database(t)
	return URI(t), db.Name()
}

// Database returns a fresh database on a connected client; both are cleaned
// up when the test ends (database dropped, client disconnected).
func Database(t testing.TB) *mongo.Database {
	t.Helper()
	uri := URI(t)
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(10 * time.Second))
	if err != nil {
		t.Fatalf("mongotest: connect %s: %v", uri, err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	if err := client.Ping(ctx, nil); err != nil {
		_ = client.Disconnect(context.WithoutCancel(ctx))
		unavailable(t, "MongoDB unreachable at %s: %v (set TEST_MONGO_URI)", uri, err)
	}
	db := client.Database(DatabaseName(t))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), 15*time.Second)
		defer cancel()
		if err := db.Drop(ctx); err != nil {
			t.Errorf("mongotest: drop database %s: %v", db.Name(), err)
		}
		if err := client.Disconnect(ctx); err != nil {
			t.Errorf("mongotest: disconnect: %v", err)
		}
	})
	return db
}

// DatabaseName returns a database name unique to this call, readable in logs:
// a prefix of the test's name and a random suffix, within FerretDB's limits
// ([a-zA-Z0-9_-], at most 63 bytes).
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

// unavailable skips t with the reason, or fails it under CI=true, where every
// dependency must be there.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("mongotest: "+format+" (required under CI=true)", args...)
	}
	t.Skipf("mongotest: "+format, args...)
}

// Commands records the commands a client sent, for tests that check how a
// write was made (its write concern, say). Safe for concurrent use.
type Commands struct {
	mu      sync.Mutex
	cmds    []*event.CommandStartedEvent
	replies map[int64]bson.Raw // by request id
}

// RepliesSince returns the replies to the commands recorded after the
// first n, named one of names, in the order the commands were sent.
func (c *Commands) RepliesSince(n int, names ...string) []bson.Raw {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []bson.Raw
	for _, e := range c.cmds[n:] {
		if r, ok := c.replies[e.RequestID]; ok && slices.Contains(names, e.CommandName) {
			out = append(out, r)
		}
	}
	return out
}

// Len is how many commands were recorded so far.
func (c *Commands) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.cmds)
}

// Since returns the commands recorded after the first n, named one of names.
func (c *Commands) Since(n int, names ...string) []*event.CommandStartedEvent {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*event.CommandStartedEvent
	for _, e := range c.cmds[n:] {
		if slices.Contains(names, e.CommandName) {
			out = append(out, e)
		}
	}
	return out
}

// Named returns the recorded commands named one of names, in order.
func (c *Commands) Named(names ...string) []*event.CommandStartedEvent {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*event.CommandStartedEvent
	for _, e := range c.cmds {
		if slices.Contains(names, e.CommandName) {
			out = append(out, e)
		}
	}
	return out
}

// Watched returns a fresh database, like Database, on a client of its own
// whose every command is recorded in the returned Commands.
func Watched(t testing.TB) (*mongo.Database, *Commands) {
	t.Helper()
	uri, name := ForTest(t)
	cmds := &Commands{replies: map[int64]bson.Raw{}}
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(10 * time.Second).
		SetMonitor(&event.CommandMonitor{
			Started: func(_ context.Context, e *event.CommandStartedEvent) {
				cmds.mu.Lock()
				cmds.cmds = append(cmds.cmds, e)
				cmds.mu.Unlock()
			},
			Succeeded: func(_ context.Context, e *event.CommandSucceededEvent) {
				cmds.mu.Lock()
				cmds.replies[e.RequestID] = e.Reply
				cmds.mu.Unlock()
			},
		}))
	if err != nil {
		t.Fatalf("mongotest: connect %s: %v", uri, err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	return client.Database(name), cmds
}

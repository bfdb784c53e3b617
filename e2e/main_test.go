package e2e

import (
	"cmp"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(suite{m},
		// With the testcontainers provider, the reaper's connection lives for
		// the whole test binary by design (it removes the containers if we
		// crash).
		goleak.IgnoreAnyFunction("github.com/testcontainers/testcontainers-go.(*Reaper).connect.func1"),
		// toxiproxy v2.12: a toxic added or removed while a link is closing
		// can leave that link's goroutines blocked forever on a channel of
		// its internal chain (seen after a long run: ToxicLink.read in
		// ChanWriter.Write, ToxicStub.Run in NoopToxic.Pipe). Their sockets
		// are closed when the proxies stop; nothing of ours is held.
		goleak.IgnoreAnyFunction("github.com/Shopify/toxiproxy/v2.(*ToxicLink).read"),
		goleak.IgnoreAnyFunction("github.com/Shopify/toxiproxy/v2/toxics.(*ToxicStub).Run"),
	)
}

// suite runs the tests, then removes the binaries they built.
type suite struct{ m *testing.M }

func (s suite) Run() int {
	code := s.m.Run()
	if dir := builds.dir; dir != "" {
		if err := os.RemoveAll(dir); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: remove built binaries: %v\n", err)
		}
	}
	return code
}

// Connection strings of this machine's services, as every test of the repo
// reads them.
func testDatabaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
}

func testAMQPURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

// unavailable skips t with the reason, or fails it under CI=true, where every
// dependency must be there.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	missingDependency(t, true, fmt.Sprintf(format, args...))
}

// missingDependency reports what this machine lacks for t: under CI=true,
// where every dependency must be there, a failure (fatal: t stops), else a
// skip of t (fatal) or a log line (the test goes on without it, as a run
// without a fault kind does: kindSkips).
func missingDependency(t testing.TB, fatal bool, msg string) {
	t.Helper()
	switch ci := os.Getenv("CI") == "true"; {
	case ci && fatal:
		t.Fatal(msg + " (required under CI=true)")
	case ci:
		t.Error(msg + " (required under CI=true)")
	case fatal:
		t.Skip(msg)
	default:
		t.Log(msg)
	}
}

// Binaries are the service binaries, built once per test binary.
type Binaries struct {
	Orders, Shipping, MongoLocal string
	// OrdersNext is orders built as the next release of pkg/outbox: one
	// more schema version (build tag outbox_next_migration), which
	// migration_under_load applies to the run's database.
	OrdersNext string
}

// builds holds the test binary's one build. Test support: one per process by
// design, removed by suite.Run.
var builds struct {
	once sync.Once
	dir  string
	bins Binaries
	err  error
}

// buildBinaries builds the real services with `go build` into a temporary
// directory, once per test binary: the suite tests what a user deploys, not
// an in-process imitation. CHAOS_RACE_SERVICES=true builds them with -race
// (slower, and hungry on 2 cores); CHAOS_BUILD_TAGS passes -tags, which
// plants a bug of make chaos-mutants (chaos.Mutants) in them.
func buildBinaries(t testing.TB) Binaries {
	t.Helper()
	builds.once.Do(func() {
		builds.err = func() error {
			root, err := moduleRoot()
			if err != nil {
				return err
			}
			goBin, err := exec.LookPath("go")
			if err != nil {
				goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
			}
			dir, err := os.MkdirTemp("", "chaos-bin-")
			if err != nil {
				return fmt.Errorf("build dir: %w", err)
			}
			builds.dir = dir
			args := []string{"build", "-o", dir + string(filepath.Separator)}
			if os.Getenv("CHAOS_RACE_SERVICES") == "true" {
				args = append(args, "-race")
			}
			tags := os.Getenv("CHAOS_BUILD_TAGS")
			if tags != "" {
				args = append(args, "-tags", tags)
			}
			args = append(args, "./services/orders", "./services/shipping", "./cmd/mongolocal")
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, goBin, args...)
			cmd.Dir = root
			start := time.Now()
			out, err := cmd.CombinedOutput()
			if err != nil {
				return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
			}
			next := filepath.Join(dir, "orders-next")
			nextArgs := []string{"build", "-o", next, "-tags", strings.Trim(tags+",outbox_next_migration", ","), "./services/orders"}
			cmd = exec.CommandContext(ctx, goBin, nextArgs...)
			cmd.Dir = root
			if out, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("go %s: %w\n%s", strings.Join(nextArgs, " "), err, out)
			}
			t.Logf("built orders, orders-next, shipping and mongolocal in %v (build tags: %q)", time.Since(start).Round(100*time.Millisecond), tags)
			builds.bins = Binaries{
				Orders:     filepath.Join(dir, "orders"),
				Shipping:   filepath.Join(dir, "shipping"),
				MongoLocal: filepath.Join(dir, "mongolocal"),
				OrdersNext: next,
			}
			return nil
		}()
	})
	if builds.err != nil {
		t.Fatalf("build the services: %v", builds.err)
	}
	return builds.bins
}

// moduleRoot is the directory of go.mod above the test's working directory.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("find module root: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("find module root: no go.mod above the working directory")
		}
		dir = parent
	}
}

// withVhost returns amqpURL with its host replaced by hostPort (when not
// empty) and its vhost by vhost.
// tempVhost adds vhost to the machine's broker with the test user's
// permissions, deletes it when t ends, and returns its URL through hostPort
// ("" keeps the test URL's host).
func tempVhost(t *testing.T, vhost, hostPort string) string {
	t.Helper()
	if err := rabbitmqctl(t.Context(), "add_vhost", vhost); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(t.Context()), time.Minute)
		defer cancel()
		if err := rabbitmqctl(ctx, "delete_vhost", vhost); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := rabbitmqctl(t.Context(), "set_permissions", "-p", vhost, userOf(t, testAMQPURL()), ".*", ".*", ".*"); err != nil {
		t.Fatal(err)
	}
	u, err := withVhost(testAMQPURL(), hostPort, vhost)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func withVhost(amqpURL, hostPort, vhost string) (string, error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return "", fmt.Errorf("parse AMQP URL: %w", err)
	}
	if hostPort != "" {
		u.Host = hostPort
	}
	u.Path = "/" + vhost
	u.RawPath = "/" + url.PathEscape(vhost)
	return u.String(), nil
}

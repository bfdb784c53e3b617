// Package pgbouncertest starts a PgBouncer of a test's own, in transaction
// pooling mode, in front of the test PostgreSQL server (TEST_DATABASE_URL, or
// postgres@127.0.0.1:5432), so that tests run the services and the outbox
// behind a real connection pooler.
//
// Start writes a configuration into a temporary directory and runs the
// pgbouncer binary (PGBOUNCER_BIN, or pgbouncer on PATH, or
// /usr/sbin/pgbouncer; the Debian package pgbouncer installs it) on a free
// loopback port, with auth_type trust; when the test runs as root it runs the
// process as the postgres user, since PgBouncer refuses to run as root. The
// process is killed when the test ends. Without the binary the test is
// skipped, and fails under CI=true.
package pgbouncertest

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Options configures a PgBouncer. The zero value is transaction pooling with
// a pool of 4 server connections per database and user.
type Options struct {
	// PoolSize is default_pool_size: server connections per database and
	// user pair. Default 4. Small pools make clients of different processes
	// share server connections, as they do in production.
	PoolSize int
	// IgnoreStartupParameters is PgBouncer's ignore_startup_parameters:
	// startup parameters it accepts from clients and drops (PgBouncer 1.18
	// refuses a connection that sends any parameter it does not track, such
	// as search_path).
	IgnoreStartupParameters []string
	// Server is the host:port of the PostgreSQL server PgBouncer connects
	// to. Default: DatabaseURL's. A port nothing answers on gives a
	// PgBouncer whose server is down: it takes client connections and
	// answers them with its errors (SQLSTATE 08P01).
	Server string
	// QueryWaitTimeout is PgBouncer's query_wait_timeout, whole seconds: how
	// long a client waits for a server connection before PgBouncer gives up
	// on it ("query_wait_timeout", SQLSTATE 08P01). Default: PgBouncer's
	// (120 s).
	QueryWaitTimeout time.Duration
}

// Bouncer is a running (or stopped) PgBouncer of one test.
type Bouncer struct {
	t    testing.TB
	bin  string
	dir  string
	conf string
	port int
	user string // the server's user, for URL
	cred *syscall.Credential

	mu   sync.Mutex // guards cmd and done
	cmd  *exec.Cmd
	done chan struct{}

	logMu sync.Mutex
	logs  bytes.Buffer
}

// DatabaseURL is where the tests find PostgreSQL: TEST_DATABASE_URL or the
// local server.
func DatabaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
}

// Binary returns the path of the pgbouncer binary, or an error saying where
// it was looked for.
func Binary() (string, error) {
	if p := os.Getenv("PGBOUNCER_BIN"); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if _, err := os.Stat(debian); err == nil {
		return debian, nil
	}
	return "", errors.New("no pgbouncer binary (PGBOUNCER_BIN, PATH, /usr/sbin/pgbouncer): install the pgbouncer package")
}

// Start starts a PgBouncer in front of DatabaseURL's server and stops it when
// the test ends. It skips the test when there is no pgbouncer binary, and
// fails it under CI=true.
func Start(t testing.TB, opts Options) *Bouncer {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PgBouncer required under CI=true: %v", err)
		}
		t.Skipf("PgBouncer not available: %v", err)
	}
	upstream, err := pgx.ParseConfig(DatabaseURL())
	if err != nil {
		t.Fatalf("parse %s: %v", DatabaseURL(), err)
	}
	b := &Bouncer{t: t, bin: bin, user: upstream.User}
	if os.Geteuid() == 0 {
		cred, err := credential("postgres")
		if err != nil {
			t.Fatalf("PgBouncer refuses to run as root, and there is no user to run it as: %v", err)
		}
		b.cred = cred
	}
	// A directory the unprivileged user can read (t.TempDir's parents are
	// private to root).
	b.dir, err = os.MkdirTemp("", "pgbouncertest-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(b.dir) })
	if err := os.Chmod(b.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := b.writeConfig(upstream, opts); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		b.Kill()
		if t.Failed() {
			t.Logf("pgbouncer log:\n%s", b.Logs())
		}
	})
	if err := b.start(); err != nil {
		t.Fatal(err)
	}
	return b
}

func credential(name string) (*syscall.Credential, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return nil, err
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, err
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

func (b *Bouncer) writeConfig(upstream *pgx.ConnConfig, opts Options) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("find a free port: %w", err)
	}
	b.port = ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()

	host, port := upstream.Host, strconv.Itoa(int(upstream.Port))
	if opts.Server != "" {
		if host, port, err = net.SplitHostPort(opts.Server); err != nil {
			return fmt.Errorf("Options.Server: %w", err)
		}
	}
	db := fmt.Sprintf("host=%s port=%s", host, port)
	if upstream.Password != "" {
		db += fmt.Sprintf(" user=%s password=%s", upstream.User, upstream.Password)
	}
	conf := strings.Join([]string{
		"[databases]",
		"* = " + db,
		"[pgbouncer]",
		"listen_addr = 127.0.0.1",
		"listen_port = " + strconv.Itoa(b.port),
		"unix_socket_dir =",
		"auth_type = trust",
		"auth_file = " + filepath.Join(b.dir, "users.txt"),
		"pool_mode = transaction",
		"default_pool_size = " + strconv.Itoa(cmp.Or(opts.PoolSize, 4)),
		"max_client_conn = 500",
		"server_login_retry = 1",
		"admin_users = " + upstream.User,
		"ignore_startup_parameters = " + strings.Join(opts.IgnoreStartupParameters, ","),
	}, "\n") + "\n"
	if opts.QueryWaitTimeout > 0 {
		conf += fmt.Sprintf("query_wait_timeout = %d\n", max(1, int(opts.QueryWaitTimeout.Round(time.Second)/time.Second)))
	}
	b.conf = filepath.Join(b.dir, "pgbouncer.ini")
	if err := os.WriteFile(b.conf, []byte(conf), 0o644); err != nil {
		return err
	}
	users := fmt.Sprintf("%q \"\"\n", upstream.User)
	return os.WriteFile(filepath.Join(b.dir, "users.txt"), []byte(users), 0o644)
}

// start runs the process and waits until it accepts connections.
func (b *Bouncer) start() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd != nil {
		return errors.New("pgbouncer already running")
	}
	cmd := exec.Command(b.bin, b.conf)
	out := &lockedWriter{mu: &b.logMu, w: &b.logs}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: b.cred, Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", b.bin, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	b.cmd, b.done = cmd, done

	deadline := time.Now().Add(15 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", b.Addr(), time.Second)
		if err == nil {
			_ = c.Close()
			break
		}
		select {
		case <-done:
			b.cmd = nil
			return fmt.Errorf("pgbouncer exited at start:\n%s", b.Logs())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pgbouncer not listening on %s after 15s: %w", b.Addr(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// stop sends sig and waits for the process to exit.
func (b *Bouncer) stop(sig syscall.Signal) {
	b.mu.Lock()
	cmd, done := b.cmd, b.done
	b.cmd = nil
	b.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// Kill stops PgBouncer with SIGKILL: every client and server connection
// drops at once. It does nothing when PgBouncer is not running.
func (b *Bouncer) Kill() { b.stop(syscall.SIGKILL) }

// Restart stops PgBouncer (SIGTERM, its immediate shutdown: client and server
// connections close, transactions in flight are lost) and starts it again on
// the same port with a fresh set of server connections.
func (b *Bouncer) Restart() {
	b.t.Helper()
	b.stop(syscall.SIGTERM)
	if err := b.start(); err != nil {
		b.t.Fatalf("restart pgbouncer: %v", err)
	}
}

// Addr is PgBouncer's host:port.
func (b *Bouncer) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)) }

// URL is a connection URL to database through PgBouncer, with query
// parameters from query (may be nil).
func (b *Bouncer) URL(database string, query url.Values) string {
	q := url.Values{"sslmode": {"disable"}}
	for k, v := range query {
		q[k] = v
	}
	u := url.URL{Scheme: "postgres", User: url.User(b.user), Host: b.Addr(), Path: "/" + database, RawQuery: q.Encode()}
	return u.String()
}

// Logs returns what PgBouncer wrote so far, over every start.
func (b *Bouncer) Logs() string {
	b.logMu.Lock()
	defer b.logMu.Unlock()
	return b.logs.String()
}

// lockedWriter serialises the process's output with the Bouncer's lock.
type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PGServer is a PostgreSQL server of a test's own: initdb in a temporary
// directory, started with pg_ctl on a free port, stopped and removed when the
// test ends. Tests use it for what they must not do to a shared server:
// promote a standby, stall synchronous replication, switch a relay from one
// server to another. It runs as the postgres system user when the test runs
// as root (PostgreSQL refuses to run as root).
type PGServer struct {
	bin  string
	cred *syscall.Credential
	dir  string // owned by the server's user: data/, the socket, the log
	port int
}

// pgBinDir finds the server's binaries, or says why there are none.
func pgBinDir() (string, *syscall.Credential, error) {
	var dir string
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dir = strings.TrimSpace(string(out))
	}
	if _, err := os.Stat(filepath.Join(dir, "pg_ctl")); dir == "" || err != nil {
		matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
		if len(matches) == 0 {
			return "", nil, errors.New("no pg_ctl found (pg_config --bindir, /usr/lib/postgresql/*/bin)")
		}
		dir = filepath.Dir(matches[len(matches)-1])
	}
	if os.Geteuid() != 0 {
		return dir, nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return "", nil, fmt.Errorf("running as root without a postgres user to run PostgreSQL as: %w", err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	return dir, &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// SweepStalePGServers stops and removes the servers of test processes that
// died before their cleanup (killed, timed out) more than an hour ago. Call
// it from TestMain.
func SweepStalePGServers() {
	bin, cred, err := pgBinDir()
	if err != nil {
		return
	}
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "outboxtest-pg-*"))
	for _, dir := range dirs {
		info, err := os.Stat(dir)
		if err != nil || time.Since(info.ModTime()) < time.Hour {
			continue
		}
		s := &PGServer{bin: bin, cred: cred, dir: dir}
		_ = s.pgctl("stop", "-m", "immediate")
		_ = os.RemoveAll(dir)
	}
}

// NewPGServer starts a primary with wal_level=logical and room for WAL
// senders and slots; settings are more "name=value" server settings.
func NewPGServer(t testing.TB, settings ...string) *PGServer {
	t.Helper()
	s := newPGDir(t)
	s.run(t, "initdb", "-D", s.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
	s.configure(t, append([]string{
		"wal_level=logical", "max_wal_senders=10", "max_replication_slots=10",
		"fsync=off", "hot_standby=on", "wal_sender_timeout=5s",
	}, settings...)...)
	s.Start(t)
	return s
}

// NewStandby makes a streaming standby of s with pg_basebackup, named
// name (its application_name, for synchronous_standby_names), and starts it.
func (s *PGServer) NewStandby(t testing.TB, name string) *PGServer {
	t.Helper()
	st := newPGDir(t)
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", s.port, name)
	st.run(t, "pg_basebackup", "-d", conninfo, "-D", st.data(), "-R", "-X", "stream", "--no-sync")
	st.configure(t, "primary_conninfo='"+conninfo+"'")
	st.Start(t)
	return st
}

func newPGDir(t testing.TB) *PGServer {
	t.Helper()
	bin, cred, err := pgBinDir()
	if err != nil {
		Unavailable(t, "a PostgreSQL server of the test's own", err)
	}
	dir, err := os.MkdirTemp("", "outboxtest-pg-")
	if err != nil {
		t.Fatal(err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	s := &PGServer{bin: bin, cred: cred, dir: dir, port: port}
	t.Cleanup(func() {
		_ = s.pgctl("stop", "-m", "immediate")
		_ = os.RemoveAll(dir)
	})
	return s
}

func (s *PGServer) data() string { return filepath.Join(s.dir, "data") }

// configure appends settings to the server's postgresql.auto.conf (a
// later line wins), read at its next start or reload.
func (s *PGServer) configure(t testing.TB, settings ...string) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(s.data(), "postgresql.auto.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, kv := range settings {
		if _, err := fmt.Fprintln(f, kv); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *PGServer) command(name string, args ...string) *exec.Cmd {
	c := exec.Command(filepath.Join(s.bin, name), args...)
	c.Dir = s.dir
	c.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	return c
}

func (s *PGServer) run(t testing.TB, name string, args ...string) {
	t.Helper()
	if out, err := s.command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", name, err, out)
	}
}

func (s *PGServer) pgctl(args ...string) error {
	args = append(args, "-D", s.data(), "-w", "-t", "60")
	if out, err := s.command("pg_ctl", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("pg_ctl %s: %w\n%s", args[0], err, out)
	}
	return nil
}

// Start starts the server (again) and waits until it accepts connections.
func (s *PGServer) Start(t testing.TB) {
	t.Helper()
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1", s.port, s.dir)
	if err := s.pgctl("start", "-l", filepath.Join(s.dir, "log"), "-o", opts); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.dir, "log"))
		t.Fatalf("%v\nserver log:\n%s", err, log)
	}
}

// Stop stops the server: mode "fast" (clients disconnected, a checkpoint)
// or "immediate" (a crash, as far as the data is concerned).
func (s *PGServer) Stop(t testing.TB, mode string) {
	t.Helper()
	if err := s.pgctl("stop", "-m", mode); err != nil {
		t.Fatal(err)
	}
}

// Promote makes a standby a primary and waits until it accepts writes.
func (s *PGServer) Promote(t testing.TB) {
	t.Helper()
	if err := s.pgctl("promote"); err != nil {
		t.Fatal(err)
	}
	WaitFor(t, "the promoted server accepting writes", 30*time.Second, func() (bool, error) {
		var inRecovery bool
		err := s.QueryRow(t, "SELECT pg_is_in_recovery()", &inRecovery)
		return err == nil && !inRecovery, nil
	})
}

// Addr is the server's host:port.
func (s *PGServer) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// URL is the connection string of database db on the server.
func (s *PGServer) URL(db string) string {
	return "postgres://postgres@" + s.Addr() + "/" + db + "?sslmode=disable"
}

// Exec runs SQL statements (several, separated by semicolons, are run in
// one implicit transaction unless they cannot be) on the postgres database.
func (s *PGServer) Exec(t testing.TB, sql string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// QueryRow scans one row of a query on the postgres database into dst.
func (s *PGServer) QueryRow(t testing.TB, sql string, dst ...any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return conn.QueryRow(ctx, sql).Scan(dst...)
}

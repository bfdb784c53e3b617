package e2e

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
	"time"

	"github.com/jackc/pgx/v5"
)

// ownPostgres is a PostgreSQL cluster of the run's own (initdb in a temporary
// directory, postgres as a child process), so a fault can restart it for
// real, immediately, as `pg_ctl -m immediate` does, without touching the
// machine's shared server. It runs as the postgres system user: PostgreSQL
// refuses to run as root.
type ownPostgres struct {
	p    *proc
	dir  string
	port string
	bin  string // initdb's directory
	cred *syscall.Credential
	disk string // the filesystem of its own its data moved to (postgres_disk_full), unmounted by close
}

// ownPostgresBinDir finds initdb and postgres, or says why the run cannot
// have a cluster of its own.
func ownPostgresBinDir() (string, *syscall.Credential, error) {
	if os.Getenv("CHAOS_OWN_POSTGRES") == "false" {
		return "", nil, errors.New("CHAOS_OWN_POSTGRES=false")
	}
	var dir string
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dir = strings.TrimSpace(string(out))
	}
	if _, err := os.Stat(filepath.Join(dir, "initdb")); dir == "" || err != nil {
		matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
		if len(matches) == 0 {
			return "", nil, errors.New("no initdb found (pg_config --bindir, /usr/lib/postgresql/*/bin)")
		}
		dir = filepath.Dir(matches[len(matches)-1])
	}
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return "", nil, fmt.Errorf("running as root without a postgres user to run PostgreSQL as: %w", err)
		}
		uid, _ := strconv.ParseUint(u.Uid, 10, 32)
		gid, _ := strconv.ParseUint(u.Gid, 10, 32)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	return dir, cred, nil
}

// startOwnPostgres creates and starts a cluster on a free port.
func startOwnPostgres(ctx context.Context, binDir string, cred *syscall.Credential, onExit func(exitEvent), logDir string) (*ownPostgres, error) {
	dir, err := os.MkdirTemp("", "chaos-pg-")
	if err != nil {
		return nil, fmt.Errorf("own PostgreSQL: %w", err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("own PostgreSQL: %w", err)
		}
	}
	data := filepath.Join(dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("own PostgreSQL: initdb: %w\n%s", err, out)
	}
	if err := appendConf(filepath.Join(data, "postgresql.conf"), "fsync = off"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	p, err := newProc(procSpec{
		name:       "postgres",
		bin:        filepath.Join(binDir, "postgres"),
		args:       ownPostgresArgs(data, port, dir),
		cred:       cred,
		stopSignal: syscall.SIGINT, // fast shutdown: SIGTERM would wait for clients
	}, logDir, onExit)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	pg := &ownPostgres{p: p, dir: dir, port: port, bin: binDir, cred: cred}
	if err := pg.start(ctx); err != nil {
		_ = pg.close()
		return nil, err
	}
	return pg, nil
}

// ownPostgresArgs are the postgres command line of a server of the run's own
// (a primary or a standby) on data, port and socket directory dir.
// fsync is off in its postgresql.conf (startOwnPostgres; a standby copies
// it), not here, so that postgres_slow_fsync can turn it on with ALTER
// SYSTEM: a process crash keeps what the OS has; only a machine crash would
// need the flushes, and this cluster lives for one run.
// wal_level=logical: the WAL relay (CHAOS_RELAY_MODE=wal) needs it; a
// standby made from it (postgres_failover) keeps it when promoted.
func ownPostgresArgs(data, port, dir string) []string {
	return []string{"-D", data, "-p", port, "-k", dir, "-c", "listen_addresses=127.0.0.1",
		"-c", "max_connections=200", "-c", "wal_level=logical", "-c", "log_min_messages=warning",
		"-c", "wal_sender_timeout=5s"}
}

// url is the connection string of database db on the cluster.
func (pg *ownPostgres) url(db string) string {
	return "postgres://postgres@" + net.JoinHostPort("127.0.0.1", pg.port) + "/" + db + "?sslmode=disable"
}

// start starts the server if it is down and waits until it accepts queries
// (after crash recovery when it was stopped immediately).
func (pg *ownPostgres) start(ctx context.Context) error {
	if err := pg.p.ensureRunning(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, pg.url("postgres"))
		if err == nil {
			return conn.Close(ctx)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("own PostgreSQL not accepting connections on port %s: %w", pg.port, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// stopImmediately is `pg_ctl -m immediate stop`: SIGQUIT makes the
// postmaster kill its backends and exit without a checkpoint, so the next
// start runs crash recovery.
func (pg *ownPostgres) stopImmediately() *incarnation {
	return pg.p.signal(syscall.SIGQUIT, 30*time.Second)
}

func (pg *ownPostgres) close() error {
	var err error
	if pg.p != nil { // nil: a standby whose pg_basebackup failed
		err = pg.p.close()
	}
	return errors.Join(err, unmount(pg.disk), os.RemoveAll(pg.dir))
}

// appendConf appends a line to a configuration file.
func appendConf(path, line string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("own PostgreSQL: %w", err)
	}
	_, werr := fmt.Fprintln(f, line)
	if err := errors.Join(werr, f.Close()); err != nil {
		return fmt.Errorf("own PostgreSQL: %w", err)
	}
	return nil
}

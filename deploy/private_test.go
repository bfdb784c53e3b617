package deploy_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
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

	"github.com/outbox-inbox/reference/internal/rabbitnode"
)

// serverProc runs a server binary as a child of the test, as user cred
// (nil: the test's own), killed with the test process (Pdeathsig), and
// returns a function that stops it with the signal stop (then SIGKILL after
// 30 seconds) and waits for it; the test's end calls it too. Its output is
// shown if the test failed.
func serverProc(t *testing.T, name string, cred *syscall.Credential, stop syscall.Signal, env []string, bin string, args ...string) func() {
	t.Helper()
	var out syncBuffer
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	var once sync.Once
	stopIt := func() {
		once.Do(func() {
			_ = cmd.Process.Signal(stop)
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
		})
	}
	t.Cleanup(func() {
		stopIt()
		if t.Failed() {
			t.Logf("%s output:\n%s", name, out.String())
		}
	})
	return stopIt
}

// systemUser returns the credentials of a system user (postgres, rabbitmq)
// for a server that refuses to run as root, or nil when the test does not
// run as root.
func systemUser(t *testing.T, name string) *syscall.Credential {
	t.Helper()
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		skipOrFail(t, "running as root without a %s user: %v", name, err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
}

// ownedTempDir is a temporary directory that cred's user owns, removed when
// the test ends.
func ownedTempDir(t *testing.T, cred *syscall.Credential) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "deploytest-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// postgresBinDir finds initdb and postgres.
func postgresBinDir(t *testing.T) string {
	t.Helper()
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if dir := strings.TrimSpace(string(out)); dir != "" {
			if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
				return dir
			}
		}
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(matches) == 0 {
		skipOrFail(t, "no initdb (pg_config --bindir, /usr/lib/postgresql/*/bin): a PostgreSQL server package is needed")
	}
	return filepath.Dir(matches[len(matches)-1])
}

// privatePostgres starts a PostgreSQL server of the test's own (initdb in a
// temporary directory, wal_level=logical, settings added with -c), so the
// test can fill its WAL and lose its slots without touching the machine's
// server. It returns the server's binaries directory and the URL of its
// postgres database.
func privatePostgres(t *testing.T, settings ...string) (binDir, dbURL string) {
	t.Helper()
	binDir = postgresBinDir(t)
	cred := systemUser(t, "postgres")
	dir := ownedTempDir(t, cred)
	data := filepath.Join(dir, "data")
	initdb := exec.Command(filepath.Join(binDir, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	_, port, _ := net.SplitHostPort(freeAddr(t))
	args := []string{"-D", data, "-p", port, "-k", dir, "-c", "listen_addresses=127.0.0.1",
		"-c", "fsync=off", "-c", "wal_level=logical", "-c", "log_min_messages=warning"}
	for _, s := range settings {
		args = append(args, "-c", s)
	}
	// SIGINT: a fast shutdown, which does not wait for clients.
	serverProc(t, "postgres", cred, syscall.SIGINT, nil, filepath.Join(binDir, "postgres"), args...)
	dbURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%s/postgres?sslmode=disable", port)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, dbURL)
		if err == nil {
			_ = conn.Close(ctx)
			return binDir, dbURL
		}
		if ctx.Err() != nil {
			t.Fatalf("private PostgreSQL on port %s never accepted a connection: %v", port, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// privateRabbitMQ starts a RabbitMQ node of the test's own, beside the
// machine's broker, with the rabbitmq_prometheus plugin on (the machine's
// broker has no plugins, and they are not changed there), and returns its
// AMQP URL and the base URL of its Prometheus endpoint.
func privateRabbitMQ(t *testing.T) (amqpURL, metricsURL string) {
	t.Helper()
	if _, err := os.Stat(rabbitnode.Server); err != nil {
		skipOrFail(t, "no RabbitMQ server (%s): %v", rabbitnode.Server, err)
	}
	cred := systemUser(t, "rabbitmq")
	dir := ownedTempDir(t, cred)
	amqpAddr, promAddr, distAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	_, amqpPort, _ := net.SplitHostPort(amqpAddr)
	_, promPort, _ := net.SplitHostPort(promAddr)
	_, distPort, _ := net.SplitHostPort(distAddr)
	files := map[string]string{
		"rabbitmq.conf": "listeners.tcp.local = 127.0.0.1:" + amqpPort + "\n" +
			"prometheus.tcp.ip = 127.0.0.1\nprometheus.tcp.port = " + promPort + "\n" +
			"log.console = true\nlog.console.level = warning\nlog.file = false\n",
		"enabled_plugins":   "[rabbitmq_prometheus].\n",
		"rabbitmq-env.conf": "", // not the machine's (its NODENAME)
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{"home", "data", "log"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
		if cred != nil {
			if err := os.Chown(filepath.Join(dir, d), int(cred.Uid), int(cred.Gid)); err != nil {
				t.Fatal(err)
			}
		}
	}
	node := randomName("deploytest") + "@localhost"
	serverProc(t, "rabbitmq "+node, cred, syscall.SIGTERM, rabbitnode.Env(dir, node, distPort), rabbitnode.Server)
	amqpURL = "amqp://guest:guest@" + amqpAddr + "/"
	metricsURL = "http://" + promAddr
	// The plugin starts once the broker runs: its endpoint answering means
	// both do.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		resp, err := http.Get(metricsURL + "/metrics")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return amqpURL, metricsURL
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("private RabbitMQ node %s never served %s/metrics: %v", node, metricsURL, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

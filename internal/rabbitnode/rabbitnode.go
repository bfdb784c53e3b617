// Package rabbitnode runs RabbitMQ nodes of a test's own beside the
// machine's broker, which it never touches: a fault that would disturb
// every user of a broker (a memory alarm that blocks publishers, a node
// killed) is made on a node nobody else uses.
//
// Each node has its own Erlang node name (<name>@localhost), AMQP port and
// distribution port (free ports picked at run time), configuration file,
// data and log directories, and no plugins. It runs as the rabbitmq user
// with a copy of the machine's Erlang cookie (in a HOME of its own), so the
// machine's rabbitmqctl reaches it with -n.
//
// Env is the environment of a node laid out by its caller (the deploy tests
// do). Prepare lays a node out and says how to run it (the e2e suite runs
// its cluster's nodes under its own supervisor); Start also runs it, waits
// until it is up, and Close stops it and removes its directory; ForTest
// does that for the length of a test.
package rabbitnode

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
	"sync"
	"syscall"
	"testing"
	"time"
)

// Server is the broker's start script. RUNNING_UNDER_SYSTEMD (in Node.Env)
// makes it exec the Erlang VM, so the process started is the node itself:
// SIGKILL kills the node, SIGTERM stops it gracefully.
const Server = "/usr/lib/rabbitmq/bin/rabbitmq-server"

const cookiePath = "/var/lib/rabbitmq/.erlang.cookie"

// Available returns why this machine cannot run a node of a test's own, or
// nil.
func Available() error {
	if _, err := os.Stat(Server); err != nil {
		return fmt.Errorf("no %s: %w", Server, err)
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		return fmt.Errorf("no rabbitmqctl: %w", err)
	}
	if _, err := user.Lookup("rabbitmq"); err != nil {
		return fmt.Errorf("no rabbitmq user: %w", err)
	}
	if os.Geteuid() != 0 {
		return errors.New("not root: the nodes run as the rabbitmq user")
	}
	if _, err := os.Stat(cookiePath); err != nil {
		return fmt.Errorf("no Erlang cookie: %w", err)
	}
	return nil
}

// RabbitAppEnv is the rabbit application's environment every node of the
// tests runs with, for its advanced.config: a quorum queue's at-least-once
// dead-letter worker sends a message again when the target has not
// confirmed it in 10 s (RabbitMQ's default is 180 s). A confirm lost
// with the target queue's leader (a node killed or cut away) otherwise
// holds the delay queue's expired messages for three minutes. A copy sent
// again is a duplicate the inbox absorbs. deploy/rabbitmq/advanced.config
// sets the same.
const RabbitAppEnv = "{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 10000}]}"

// Node is a node laid out on disk, not necessarily running.
type Node struct {
	// Name is the Erlang node name, "<name>@localhost".
	Name string
	// Port is its AMQP port on 127.0.0.1.
	Port string
	// Dir holds its configuration, data and logs.
	Dir string
	// Env is the environment to run Server with (on top of PATH).
	Env []string
	// Cred runs Server as the rabbitmq user.
	Cred *syscall.Credential
}

// Prepare lays out a node named name@localhost in dir (created, and handed
// to the rabbitmq user; dir's parent must be traversable by that user).
func Prepare(dir, name string) (*Node, error) {
	u, err := user.Lookup("rabbitmq")
	if err != nil {
		return nil, fmt.Errorf("rabbitmq node %s: %w", name, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	cookie, err := os.ReadFile(cookiePath)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq node %s: read the Erlang cookie: %w", name, err)
	}
	home := filepath.Join(dir, "home")
	for _, d := range []string{home, filepath.Join(dir, "data"), filepath.Join(dir, "log")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("rabbitmq node %s: %w", name, err)
		}
	}
	amqpPort, err := freePort()
	if err != nil {
		return nil, err
	}
	distPort, err := freePort()
	if err != nil {
		return nil, err
	}
	files := map[string]string{
		// The machine's /etc/rabbitmq/rabbitmq.conf pins 5672: the listener
		// is set here, in a file of the node's own.
		"rabbitmq.conf":     "listeners.tcp.local = 127.0.0.1:" + amqpPort + "\nlog.console = true\nlog.console.level = warning\nlog.file = false\n",
		"advanced.config":   "[" + RabbitAppEnv + "].\n",
		"enabled_plugins":   "[].\n",
		"rabbitmq-env.conf": "", // not the machine's (its NODENAME)
	}
	for f, content := range files {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(content), 0o644); err != nil {
			return nil, fmt.Errorf("rabbitmq node %s: %w", name, err)
		}
	}
	if err := os.WriteFile(filepath.Join(home, ".erlang.cookie"), cookie, 0o400); err != nil {
		return nil, fmt.Errorf("rabbitmq node %s: cookie: %w", name, err)
	}
	if err := filepath.Walk(dir, func(path string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(path, uid, gid)
	}); err != nil {
		return nil, fmt.Errorf("rabbitmq node %s: chown: %w", name, err)
	}
	node := name + "@localhost"
	return &Node{
		Name: node,
		Port: amqpPort,
		Dir:  dir,
		Env: append(Env(dir, node, distPort),
			"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}"),
		Cred: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)},
	}, nil
}

// Env is the environment that runs node (name@host) from dir: its HOME
// (dir/home, where the Erlang cookie goes), its configuration files
// (rabbitmq.conf, advanced.config, enabled_plugins, rabbitmq-env.conf, an
// empty one so the machine's NODENAME is not read), its data (dir/data),
// logs (dir/log) and pid file, with distribution on distPort and epmd on
// loopback.
func Env(dir, node, distPort string) []string {
	return []string{
		"HOME=" + filepath.Join(dir, "home"),
		"RABBITMQ_NODENAME=" + node,
		"RABBITMQ_DIST_PORT=" + distPort,
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE=" + filepath.Join(dir, "advanced.config"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(dir, "rabbitmq-env.conf"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(dir, "data"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(dir, "log"),
		"RABBITMQ_PID_FILE=" + filepath.Join(dir, "rabbit.pid"),
		"ERL_EPMD_ADDRESS=127.0.0.1",
		"ERL_CRASH_DUMP=" + filepath.Join(dir, "erl_crash.dump"),
		"RUNNING_UNDER_SYSTEMD=true",
	}
}

// URL is the node's AMQP URL for the guest user (allowed from loopback) on
// vhost "/".
func (n *Node) URL() string {
	return "amqp://guest:guest@" + net.JoinHostPort("127.0.0.1", n.Port) + "/"
}

// Ctl runs rabbitmqctl against the node (at most two minutes) and returns
// its output.
func (n *Node) Ctl(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "rabbitmqctl", append([]string{"-q", "-n", n.Name}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("rabbitmqctl -n %s %s: %w: %s", n.Name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// AwaitStartup waits until the node's application runs, at most three
// minutes. rabbitmqctl await_startup fails at once while the booting VM has
// not registered with epmd yet (slow on a loaded machine), so it is asked
// again until then.
func (n *Node) AwaitStartup(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		_, err := n.Ctl(ctx, "await_startup", "--timeout", "90")
		if err == nil {
			return nil
		}
		t := time.NewTimer(time.Second)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("rabbitmq node %s did not start: %w", n.Name, err)
		case <-t.C:
		}
	}
}

// Running is a node started by Start.
type Running struct {
	*Node
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{} // closed once the process has exited and been reaped
	once sync.Once
	err  error
}

// Start lays out a node named <prefix>-<random>@localhost in a new
// temporary directory, runs it (it dies with this process: SIGKILL when
// the test binary goes), and waits until it is up.
func Start(ctx context.Context, prefix string) (*Running, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", prefix+"-rabbit-")
	if err != nil {
		return nil, fmt.Errorf("rabbitmq node: %w", err)
	}
	if err := os.Chmod(dir, 0o755); err != nil { // traversable by the rabbitmq user
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("rabbitmq node: %w", err)
	}
	node, err := Prepare(filepath.Join(dir, "node"), prefix+"-"+strconv.FormatInt(time.Now().UnixNano()%1e9, 36))
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	node.Dir = dir // Close removes it all
	out := &syncBuffer{}
	cmd := exec.Command(Server)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, node.Env...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = sysProcAttr(node.Cred)
	if err := cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("start rabbitmq node %s: %w", node.Name, err)
	}
	r := &Running{Node: node, cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(r.done)
	}()
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // a node that dies while booting ends the wait
		select {
		case <-r.done:
			cancel()
		case <-actx.Done():
		}
	}()
	if err := node.AwaitStartup(actx); err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("%w; its output:\n%s", err, r.out.tail(20))
	}
	return r, nil
}

// Close stops the node (SIGTERM, a graceful stop; SIGKILL after 30s) and
// removes its directory. It is safe to call more than once.
func (r *Running) Close() error {
	r.once.Do(func() {
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			_ = r.cmd.Process.Kill()
			<-r.done
		}
		r.err = os.RemoveAll(r.Dir)
	})
	return r.err
}

// Output returns the last lines the node printed (warnings and errors).
func (r *Running) Output() string { return r.out.tail(50) }

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return port, nil
}

type syncBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b = append(s.b, p...)
	return len(p), nil
}

func (s *syncBuffer) tail(n int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	lines := strings.Split(strings.TrimSpace(string(s.b)), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// ForTest starts a node for t (Start) and stops it when t ends, printing
// what the node said if t failed. Where no node can run here it skips t,
// or fails it under CI=true.
func ForTest(t testing.TB, prefix string) *Running {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("rabbitnode: no RabbitMQ node of the test's own: %v (required under CI=true)", err)
		}
		t.Skipf("rabbitnode: no RabbitMQ node of the test's own: %v", err)
	}
	n, err := Start(t.Context(), prefix)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node %s said:\n%s", n.Name, n.Output())
		}
		if err := n.Close(); err != nil {
			t.Errorf("rabbitnode: close node %s: %v", n.Name, err)
		}
	})
	return n
}

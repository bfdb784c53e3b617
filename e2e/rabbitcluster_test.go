package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/outbox-inbox/reference/e2e/chaos"
	"github.com/outbox-inbox/reference/internal/rabbitnode"
)

// rabbitCluster is a RabbitMQ cluster of the run's own: three nodes on this
// machine beside its own broker, which it never touches, each laid out by
// internal/rabbitnode (node name <run>-<i>@localhost, ports, directories
// and configuration of its own, the rabbitmq user) and run under the
// harness's supervisor. Nodes 2 and 3 join node 1 (stop_app, join_cluster,
// start_app). Every node is stopped in close, and killed with the test
// binary (Pdeathsig).
type rabbitCluster struct {
	dir   string // the nodes' directories, removed by close
	nodes []*rabbitNode
	net   *nodeNet // the nodes' network namespaces, nil when they share loopback

	mu      sync.Mutex
	stopped map[int]bool // app stopped by a fault, not started since
}

type rabbitNode struct {
	i      int    // from 1
	name   string // Erlang node name
	host   string // its AMQP listener's address: 127.0.0.1, or its namespace's
	port   string // AMQP
	inetrc string // ERL_INETRC for rabbitmqctl, "" on loopback
	node   *rabbitnode.Node
	p      *proc
}

// rabbitClusterAvailable says why this machine cannot run a cluster of the
// run's own, or nil.
func rabbitClusterAvailable() error { return rabbitnode.Available() }

// startRabbitCluster starts n nodes named <prefix>-<i>@localhost and
// clusters them. Their logs go to logDir; their data to a temporary
// directory that the rabbitmq user can reach, removed by close. With netns,
// each node runs in a network namespace of its own (nodeNet), named
// <prefix>-<i>@<its namespace>, so that they can be partitioned.
func startRabbitCluster(ctx context.Context, prefix, logDir string, n int, netns bool, onExit func(exitEvent), logf func(string, ...any)) (*rabbitCluster, error) {
	dir, err := os.MkdirTemp("", prefix+"-rabbit-")
	if err != nil {
		return nil, fmt.Errorf("rabbitmq cluster: %w", err)
	}
	// Traversable by the rabbitmq user; the nodes' own directories are
	// theirs.
	if err := os.Chmod(dir, 0o755); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("rabbitmq cluster: %w", err)
	}
	rc := &rabbitCluster{dir: dir, stopped: make(map[int]bool)}
	if netns {
		if rc.net, err = newNodeNet(ctx, dir, n); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	for i := 1; i <= n; i++ {
		node, err := newRabbitNode(i, prefix, dir, logDir, rc.net, onExit)
		if err != nil {
			_ = rc.close(ctx)
			return nil, err
		}
		rc.nodes = append(rc.nodes, node)
		if _, err := node.p.start(); err != nil {
			_ = rc.close(ctx)
			return nil, err
		}
	}
	start := time.Now()
	for _, node := range rc.nodes {
		if err := node.awaitStartup(ctx); err != nil {
			_ = rc.close(ctx)
			return nil, err
		}
	}
	for _, node := range rc.nodes[1:] {
		for _, args := range [][]string{{"stop_app"}, {"join_cluster", rc.nodes[0].name}, {"start_app"}} {
			if _, err := node.ctl(ctx, args...); err != nil {
				_ = rc.close(ctx)
				return nil, err
			}
		}
	}
	where := "on loopback"
	if rc.net != nil {
		where = "each in a network namespace of its own on " + rc.net.net + ".0/24, pause_minority"
	}
	logf("rabbitmq cluster: %s up and clustered in %v (%s)", strings.Join(rc.names(), ", "), time.Since(start).Round(100*time.Millisecond), where)
	return rc, nil
}

func newRabbitNode(i int, prefix, dir, logDir string, net *nodeNet, onExit func(exitEvent)) (*rabbitNode, error) {
	name := prefix + "-" + strconv.Itoa(i)
	nodeDir := filepath.Join(dir, "rabbit-"+strconv.Itoa(i))
	node, err := rabbitnode.Prepare(nodeDir, name)
	if err != nil {
		return nil, err
	}
	spec := procSpec{name: chaos.NodeName(i), bin: rabbitnode.Server, env: node.Env, cred: node.Cred}
	rn := &rabbitNode{i: i, name: node.Name, host: "127.0.0.1", port: node.Port, node: node}
	if net == nil {
		// pause_minority, as on a cluster in namespaces (docs/cluster.md).
		if err := appendFile(filepath.Join(nodeDir, "rabbitmq.conf"), "cluster_partition_handling = pause_minority\n"); err != nil {
			return nil, err
		}
	} else {
		var env []string
		if rn.name, env, spec.bin, spec.args, err = net.nodeSetup(nodeDir, name, node.Port, i, rabbitnode.Server); err != nil {
			return nil, err
		}
		// Later entries win: the node's name, addresses and inetrc.
		spec.env = append(append([]string{}, node.Env...), env...)
		spec.cred = nil // ip netns exec runs as root, setpriv then drops to rabbitmq
		node.Name = rn.name
		rn.host, rn.inetrc = net.ip(i), net.inetrc
	}
	p, err := newProc(spec, logDir, onExit)
	if err != nil {
		return nil, err
	}
	// A node that died on its own comes back after a pause, like under an
	// init system.
	p.restart = time.Second
	rn.p = p
	return rn, nil
}

func (rc *rabbitCluster) names() []string {
	var out []string
	for _, n := range rc.nodes {
		out = append(out, n.name)
	}
	return out
}

// addrs are the nodes' AMQP addresses, in node order.
func (rc *rabbitCluster) addrs() []string {
	var out []string
	for _, n := range rc.nodes {
		out = append(out, net.JoinHostPort(n.host, n.port))
	}
	return out
}

func (rc *rabbitCluster) node(target string) (*rabbitNode, error) {
	for _, n := range rc.nodes {
		if chaos.NodeName(n.i) == target {
			return n, nil
		}
	}
	return nil, fmt.Errorf("no RabbitMQ node %q", target)
}

// ctl runs rabbitmqctl against the first node that answers: a fault may have
// any one of them down.
func (rc *rabbitCluster) ctl(ctx context.Context, args ...string) (string, error) {
	var errs []error
	for _, n := range rc.nodes {
		if n.p.current() == nil {
			continue
		}
		out, err := n.ctl(ctx, args...)
		if err == nil {
			return out, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	return "", errors.Join(append(errs, fmt.Errorf("rabbitmqctl %s: no node answered", strings.Join(args, " ")))...)
}

func (n *rabbitNode) ctl(ctx context.Context, args ...string) (string, error) {
	if n.inetrc == "" {
		return n.node.Ctl(ctx, args...)
	}
	return n.cli(ctx, "rabbitmqctl", args...)
}

// cli runs a RabbitMQ command line tool (rabbitmqctl, rabbitmq-queues)
// against the node, at most two minutes, with the network's inetrc when it
// has one.
func (n *rabbitNode) cli(ctx context.Context, tool string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, tool, append([]string{"-q", "-n", n.name}, args...)...)
	// The tool runs its Erlang VM under su: on ctx's end the whole group
	// goes, not su alone.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if n.inetrc != "" {
		cmd.Env = append(os.Environ(), "ERL_INETRC="+n.inetrc)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s -n %s %s: %w: %s", tool, n.name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// awaitStartup waits until the node's app runs, starting its process if it is
// down.
func (n *rabbitNode) awaitStartup(ctx context.Context) error {
	if err := n.p.ensureRunning(); err != nil {
		return err
	}
	var last error
	for range 3 { // the CLI may not reach a VM that is still booting
		if _, last = n.ctl(ctx, "await_startup", "--timeout", "90"); last == nil {
			return nil
		}
		if ctx.Err() != nil {
			break
		}
		sleep(ctx, 2*time.Second)
	}
	return fmt.Errorf("rabbitmq node %s did not start: %w; its last lines:\n%s", n.name, last, tail(n.p.log.Name(), 15))
}

// leader names the node leading queue in vhost, e.g. "node-2". A queue
// that does not answer yet (just after a node's restart, it may not for a
// minute on a loaded machine) is asked again, for up to three minutes.
func (rc *rabbitCluster) leader(ctx context.Context, vhost, queue string) (string, error) {
	deadline := time.Now().Add(3 * time.Minute)
	for {
		leader, err := rc.leaderOnce(ctx, vhost, queue)
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return leader, err
		}
		sleep(ctx, 3*time.Second)
	}
}

func (rc *rabbitCluster) leaderOnce(ctx context.Context, vhost, queue string) (string, error) {
	states, err := rc.queueStates(ctx, vhost, queue)
	if err != nil {
		return "", err
	}
	st, ok := states[queue]
	if !ok {
		return "", fmt.Errorf("queue %s of vhost %s not declared or not answering", queue, vhost)
	}
	for _, n := range rc.nodes {
		if n.name == st.leader {
			return chaos.NodeName(n.i), nil
		}
	}
	return "", fmt.Errorf("queue %s: leader %s is none of the run's nodes", queue, st.leader)
}

// stopApp stops the node's RabbitMQ application (the VM stays up); startApp
// starts it again.
func (rc *rabbitCluster) stopApp(ctx context.Context, n *rabbitNode) error {
	rc.mu.Lock()
	rc.stopped[n.i] = true
	rc.mu.Unlock()
	_, err := n.ctl(ctx, "stop_app")
	return err
}

func (rc *rabbitCluster) startApp(ctx context.Context, n *rabbitNode) error {
	if _, err := n.ctl(ctx, "start_app"); err != nil {
		return err
	}
	if err := n.awaitStartup(ctx); err != nil {
		return err
	}
	rc.mu.Lock()
	delete(rc.stopped, n.i)
	rc.mu.Unlock()
	return nil
}

// heal ends every partition, starts every node that is down and every app
// a fault stopped.
func (rc *rabbitCluster) heal(ctx context.Context) error {
	var errs []error
	if rc.net != nil {
		errs = append(errs, rc.net.heal(ctx))
	}
	for _, n := range rc.nodes {
		rc.mu.Lock()
		stopped := rc.stopped[n.i]
		rc.mu.Unlock()
		if stopped && n.p.current() != nil {
			errs = append(errs, rc.startApp(ctx, n))
			continue
		}
		if n.p.current() == nil {
			errs = append(errs, n.awaitStartup(ctx))
		}
	}
	return errors.Join(errs...)
}

// close stops every node (SIGTERM, a graceful stop; SIGKILL after 15s).
func (rc *rabbitCluster) close(ctx context.Context) error {
	var errs []error
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, n := range rc.nodes {
		wg.Go(func() {
			if err := n.p.close(); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if rc.net != nil {
		errs = append(errs, rc.net.close(context.WithoutCancel(ctx)))
	}
	return errors.Join(append(errs, os.RemoveAll(rc.dir))...)
}

func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("append to %s: %w", path, err)
	}
	_, err = f.WriteString(text)
	return errors.Join(err, f.Close())
}

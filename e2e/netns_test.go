package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/e2e/chaos"
	"github.com/outbox-inbox/reference/internal/rabbitnode"
)

// nodeNet is a network of the run's own for its RabbitMQ nodes, so that a
// fault can partition them: each node runs in a network namespace of its own
// (ip netns), with an address 10.213.X.i on a veth pair whose other end is on
// a bridge of the run's own, which also carries 10.213.X.254 for this
// machine's side (the clients' proxies and rabbitmqctl). A partition is
// blackhole routes between nodes' namespaces; the machine's side still
// reaches every node. Nothing outside the run's own interfaces and
// namespaces changes, and close removes them all.
//
// Erlang's short node names need host names: an inetrc file of the run's own
// (ERL_INETRC, read by every Erlang VM, the nodes' and rabbitmqctl's) maps
// each node's host name to its address. Each node's epmd runs in its
// namespace, on its loopback and its address.
type nodeNet struct {
	prefix string // names of the namespaces and interfaces, e.g. "cc1f2e"
	net    string // "10.213.X"
	n      int
	inetrc string
}

// netnsAvailable says why nodes cannot run in namespaces here, or nil.
func netnsAvailable() error {
	if os.Getenv("CHAOS_NETNS") == "false" {
		return errors.New("CHAOS_NETNS=false")
	}
	if os.Geteuid() != 0 {
		return errors.New("not root")
	}
	for _, bin := range []string{"ip", "setpriv"} {
		if _, err := exec.LookPath(bin); err != nil {
			return fmt.Errorf("no %s: %w", bin, err)
		}
	}
	return nil
}

// newNodeNet makes the bridge, n namespaces and their veth pairs, and the
// inetrc file in dir.
func newNodeNet(ctx context.Context, dir string, n int) (*nodeNet, error) {
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	nn := &nodeNet{prefix: "cc" + hex.EncodeToString(b[:2]), net: "10.213." + strconv.Itoa(int(b[2])), n: n}
	if out, _ := exec.CommandContext(ctx, "ip", "-4", "addr").CombinedOutput(); strings.Contains(string(out), " "+nn.net+".") {
		return nil, fmt.Errorf("node network: %s.0/24 is in use here", nn.net)
	}
	cmds := [][]string{
		{"link", "add", nn.bridge(), "type", "bridge"},
		{"addr", "add", nn.net + ".254/24", "dev", nn.bridge()},
		{"link", "set", nn.bridge(), "up"},
	}
	var rc strings.Builder
	for i := 1; i <= n; i++ {
		ns, host, peer := nn.ns(i), nn.hostVeth(i), nn.nodeVeth(i)
		cmds = append(cmds,
			[]string{"netns", "add", ns},
			[]string{"-n", ns, "link", "set", "lo", "up"},
			[]string{"link", "add", host, "type", "veth", "peer", "name", peer},
			[]string{"link", "set", peer, "netns", ns},
			[]string{"link", "set", host, "master", nn.bridge(), "up"},
			[]string{"-n", ns, "addr", "add", nn.ip(i) + "/24", "dev", peer},
			[]string{"-n", ns, "link", "set", peer, "up"},
		)
		fmt.Fprintf(&rc, "{host, {%s}, [%q]}.\n", strings.ReplaceAll(nn.ip(i), ".", ","), nn.host(i))
	}
	rc.WriteString("{lookup, [file, native]}.\n")
	for _, args := range cmds {
		if err := ipCmd(ctx, args...); err != nil {
			return nil, errors.Join(err, nn.close(context.WithoutCancel(ctx)))
		}
	}
	nn.inetrc = filepath.Join(dir, "inetrc")
	if err := os.WriteFile(nn.inetrc, []byte(rc.String()), 0o644); err != nil {
		return nil, errors.Join(fmt.Errorf("node network: %w", err), nn.close(context.WithoutCancel(ctx)))
	}
	return nn, nil
}

func (nn *nodeNet) bridge() string        { return nn.prefix + "b" }
func (nn *nodeNet) ns(i int) string       { return nn.prefix + "n" + strconv.Itoa(i) }
func (nn *nodeNet) host(i int) string     { return nn.ns(i) } // the node's Erlang host name
func (nn *nodeNet) hostVeth(i int) string { return nn.prefix + "h" + strconv.Itoa(i) }
func (nn *nodeNet) nodeVeth(i int) string { return nn.prefix + "v" + strconv.Itoa(i) }
func (nn *nodeNet) ip(i int) string       { return nn.net + "." + strconv.Itoa(i) }

// nodeSetup adapts a node laid out by rabbitnode.Prepare in dir to run as
// node i of the network: its AMQP listener on its address, distribution
// and epmd on its address too, guest allowed from the bridge (the clients'
// proxies and the harness are on this machine's side of it), the network's
// inetrc, a 10s net_ticktime so
// that a partition is seen in about 10s rather than a minute, and
// pause_minority (see docs/cluster.md). It returns the node name, the
// environment to add, and how to start it (ip netns exec, then setpriv to
// the rabbitmq user, which sets the parent-death signal again: the change
// of user cleared the one the harness set).
func (nn *nodeNet) nodeSetup(dir, name, port string, i int, server string) (node string, env []string, bin string, args []string, err error) {
	u, err := user.Lookup("rabbitmq")
	if err != nil {
		return "", nil, "", nil, fmt.Errorf("node network: %w", err)
	}
	conf := "listeners.tcp.local = " + nn.ip(i) + ":" + port + "\nlog.console = true\nlog.console.level = warning\nlog.file = false\n" +
		"cluster_partition_handling = pause_minority\n" +
		// The clients reach it from the bridge, not from its loopback.
		"loopback_users = none\n"
	files := map[string]string{
		"rabbitmq.conf":   conf,
		"advanced.config": "[{kernel, [{net_ticktime, 10}]}, " + rabbitnode.RabbitAppEnv + "].\n",
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	for f, content := range files {
		path := filepath.Join(dir, f)
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			return "", nil, "", nil, fmt.Errorf("node network: %w", err)
		}
		if err := os.Chown(path, uid, gid); err != nil {
			return "", nil, "", nil, fmt.Errorf("node network: %w", err)
		}
	}
	node = name + "@" + nn.host(i)
	env = []string{
		"RABBITMQ_NODENAME=" + node,
		"ERL_EPMD_ADDRESS=127.0.0.1," + nn.ip(i),
		"ERL_INETRC=" + nn.inetrc,
		"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {" + strings.ReplaceAll(nn.ip(i), ".", ",") + "}",
	}
	args = []string{"netns", "exec", nn.ns(i), "setpriv", "--reuid=" + u.Uid, "--regid=" + u.Gid, "--clear-groups", "--pdeathsig", "KILL", server}
	return node, env, "ip", args, nil
}

// partition cuts node a away from each of others, both ways.
func (nn *nodeNet) partition(ctx context.Context, a int, others []int) error {
	var errs []error
	for _, b := range others {
		errs = append(errs,
			ipCmd(ctx, "-n", nn.ns(a), "route", "add", "blackhole", nn.ip(b)+"/32"),
			ipCmd(ctx, "-n", nn.ns(b), "route", "add", "blackhole", nn.ip(a)+"/32"))
	}
	return errors.Join(errs...)
}

// heal removes every blackhole route of the network.
func (nn *nodeNet) heal(ctx context.Context) error {
	var errs []error
	for i := 1; i <= nn.n; i++ {
		out, err := exec.CommandContext(ctx, "ip", "-n", nn.ns(i), "route", "show", "type", "blackhole").CombinedOutput()
		if err != nil {
			errs = append(errs, fmt.Errorf("ip -n %s route show: %w: %s", nn.ns(i), err, out))
			continue
		}
		for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "blackhole" {
				errs = append(errs, ipCmd(ctx, "-n", nn.ns(i), "route", "del", "blackhole", f[1]))
			}
		}
	}
	return errors.Join(errs...)
}

// close kills whatever still runs in the namespaces (an epmd the nodes
// started), deletes them (their veth pairs go with them) and the bridge.
func (nn *nodeNet) close(ctx context.Context) error {
	var errs []error
	for i := 1; i <= nn.n; i++ {
		out, err := exec.CommandContext(ctx, "ip", "netns", "pids", nn.ns(i)).Output()
		if err != nil {
			continue // not made
		}
		for f := range strings.FieldsSeq(string(out)) {
			if pid, err := strconv.Atoi(f); err == nil {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		// The killed processes leave the namespace once reaped.
		time.Sleep(100 * time.Millisecond)
		errs = append(errs, ipCmd(ctx, "netns", "del", nn.ns(i)))
	}
	if err := exec.CommandContext(ctx, "ip", "link", "show", nn.bridge()).Run(); err == nil {
		errs = append(errs, ipCmd(ctx, "link", "del", nn.bridge()))
	}
	return errors.Join(errs...)
}

func ipCmd(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// partitionable says whether the run's cluster runs in network namespaces
// (nodeNet): a cluster run does where this machine allows it; where it does
// not (not root, no ip or setpriv, CHAOS_NETNS=false), the partition fault
// is left out and skips says why.
func partitionable(skips *kindSkips, p chaos.Profile, topo chaos.Topology) (chaos.Profile, bool) {
	skips.t.Helper()
	if topo.Nodes < 3 || !slices.Contains(p.Kinds, chaos.FaultNodePartition) {
		return p, false
	}
	if err := netnsAvailable(); err != nil {
		return skips.without(p, "CHAOS_NETNS", fmt.Errorf("the cluster's nodes on loopback: %w", err), chaos.FaultNodePartition), false
	}
	return p, true
}

// partitionNode cuts n away from the other nodes (its clients still reach
// it) and waits until n paused itself (pause_minority: its app stops, its
// clients are disconnected), runs during, then heals the partition and waits
// until n runs again and no node reports a partition. It says how long n
// took to pause and to come back.
func (rc *rabbitCluster) partitionNode(ctx context.Context, n *rabbitNode, during func() error) (string, error) {
	if rc.net == nil {
		return "", errors.New("the run's nodes share loopback: no partition without network namespaces")
	}
	healCtx := context.WithoutCancel(ctx)
	var others []int
	for _, o := range rc.nodes {
		if o != n {
			others = append(others, o.i)
		}
	}
	start := time.Now()
	healed := false
	defer func() {
		if !healed {
			_ = rc.net.heal(healCtx)
		}
	}()
	if err := rc.net.partition(ctx, n.i, others); err != nil {
		return "", err
	}
	pausedErr := n.waitRunning(ctx, false)
	paused := time.Since(start)
	duringErr := during()
	healErr := rc.net.heal(healCtx)
	healed = healErr == nil
	back := time.Now()
	errs := []error{pausedErr, duringErr, healErr}
	if healErr == nil {
		errs = append(errs, n.waitRunning(healCtx, true), rc.waitWhole(healCtx))
	}
	if err := errors.Join(errs...); err != nil {
		return "", err
	}
	return fmt.Sprintf("paused itself %v after the cut (pause_minority), running again with the cluster whole %v after the heal",
		paused.Round(100*time.Millisecond), time.Since(back).Round(100*time.Millisecond)), nil
}

// waitRunning waits (at most three minutes) until n's RabbitMQ application
// runs (on) or does not (a paused or stopped node).
func (n *rabbitNode) waitRunning(ctx context.Context, on bool) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	want := strconv.FormatBool(on)
	for {
		callCtx, cancelCall := context.WithTimeout(ctx, 20*time.Second)
		out, err := n.ctl(callCtx, "eval", "rabbit:is_running().")
		cancelCall()
		if err == nil && strings.TrimSpace(out) == want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: running %q after three minutes, want %s (%v)", n.name, strings.TrimSpace(out), want, err)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// waitWhole waits (at most three minutes) until every node runs, sees every
// other running, and reports no partition.
func (rc *rabbitCluster) waitWhole(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	for {
		var problems []string
		for _, n := range rc.nodes {
			// Each call bounded.
			callCtx, cancelCall := context.WithTimeout(ctx, 20*time.Second)
			out, err := n.ctl(callCtx, "eval", "{rabbit_mnesia:cluster_nodes(running), rabbit_node_monitor:partitions()}.")
			cancelCall()
			// One term, printed over several lines when long.
			out = strings.Join(strings.Fields(out), "")
			switch {
			case err != nil:
				problems = append(problems, err.Error())
			case !strings.HasSuffix(out, ",[]}"):
				problems = append(problems, n.name+": partitions "+strings.TrimSpace(out))
			default:
				for _, o := range rc.nodes {
					if !strings.Contains(out, o.name) {
						problems = append(problems, n.name+" does not see "+o.name+" running")
					}
				}
			}
		}
		if len(problems) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("rabbitmq cluster not whole after three minutes: %s", strings.Join(problems, "; "))
		case <-time.After(time.Second):
		}
	}
}

// TestChaosClusterPartition runs the flow on the run's own three-node
// cluster, its nodes in network namespaces, for a minute of load with one
// or two partitions (by the plan) (a node cut from the two others, which pauses itself under
// pause_minority and comes back when the partition heals), a relay kill and
// a shipping crash between its inbox record and its ack:
// the checker's invariants must hold and the clients must have left each
// partitioned node. It runs with the cluster profile (make chaos-cluster),
// as root with ip and setpriv.
func TestChaosClusterPartition(t *testing.T) {
	if os.Getenv("CHAOS_PROFILE") != "cluster" {
		t.Skip("starts three RabbitMQ nodes in network namespaces: runs with CHAOS_PROFILE=cluster (make chaos-cluster)")
	}
	if err := errors.Join(rabbitClusterAvailable(), netnsAvailable()); err != nil {
		unavailable(t, "no partitionable RabbitMQ cluster of the run's own here: %v", err)
	}
	seed, err := seedFromEnv(os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	provider, err := chooseProvider(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	pgBinDir, pgCred, err := ownPostgresBinDir()
	if err != nil {
		t.Logf("postgres: the shared server: %v", err)
	}
	profile := chaos.Profile{
		Name: "cluster_partition", Load: 60 * time.Second, Warmup: 10 * time.Second, Cooldown: 8 * time.Second,
		Clients: 3, Rate: 8, CancelRatio: 0.4,
		// The crash point redelivers an event shipping applied: the
		// checker wants a duplicate absorbed (I4).
		Kinds: []chaos.FaultKind{chaos.FaultNodePartition, chaos.FaultKillRelay, chaos.FaultCrashShippingAfterInbox}, Faults: 4,
		HoldMin: 3 * time.Second, HoldMax: 8 * time.Second, DrainBudget: 3 * time.Minute,
	}
	topo := chaos.Topology{Relays: 2, Consumers: 2, Nodes: 3}
	plan, err := chaos.NewPlan(seed, profile, topo)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range plan {
		t.Logf("plan: %v", s)
	}
	report := runScenario(t, scenario{seed: seed, profile: profile, plan: plan, provider: provider, topo: topo, pgBinDir: pgBinDir, pgCred: pgCred, netns: true})
	t.Log(report.Summary())
	for _, v := range report.Violations {
		t.Errorf("violation: %v", v)
	}
}

package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// nodeFault injects a fault on nodes of the run's RabbitMQ cluster:
//
//   - node_kill, node_kill_leader: SIGKILL of the target (or of the node
//     leading shipping's queue), started again after s.Hold;
//   - node_app_restart: rabbitmqctl stop_app, start_app after s.Hold;
//   - node_proxy_down: the node's proxies disabled, which cuts it away from
//     every client while the nodes still see each other;
//   - node_majority_down: the two nodes other than the target SIGKILLed at
//     once (quorum queues lose their majority: publishing stops; the target
//     must pause itself, pause_minority), started again after s.Hold;
//   - node_wipe: the target killed, its data directory wiped, forgotten by
//     the cluster, started empty and joined again (see wipeNode);
//   - node_partition: the target cut from the other nodes by a network
//     partition between their namespaces, not from its clients; with
//     pause_minority it pauses itself, and runs again once the partition
//     heals (see rabbitCluster.partitionNode).
//
// While the nodes are down (but for the majority loss, where no node takes
// clients), every client that was connected to one of them
// must have left it: clientsLeft waits (up to a minute and a half past the
// hold) until none of the run's connections is listed on a down node and
// each client name has as many new connections on the nodes still up as it
// had on the down ones, records where each went, and fails the fault
// otherwise.
func (in *injector) nodeFault(ctx context.Context, s chaos.Step, f *chaos.Fault, record func(string)) error {
	rc := in.c.rabbit
	if rc == nil {
		return errors.New("the run has no RabbitMQ cluster of its own")
	}
	target := s.Target
	extra := ""
	if s.Kind == chaos.FaultNodeKillLeader {
		leader, err := rc.leader(ctx, in.c.vhost, mainQueue)
		if err != nil {
			return err
		}
		target, extra = leader, " (leader of "+mainQueue+")"
		f.Target = leader
	}
	n, err := rc.node(target)
	if err != nil {
		return err
	}
	down := []*rabbitNode{n}
	if s.Kind == chaos.FaultNodeMajorityDown {
		down = slices.DeleteFunc(slices.Clone(rc.nodes), func(o *rabbitNode) bool { return o == n })
	}
	before, err := rc.connections(ctx, in.c.vhost)
	if err != nil {
		in.logf("fault %v: list connections before: %v", s, err)
	}
	start := time.Now()
	// A fault is always healed, whatever ctx does.
	healCtx := context.WithoutCancel(ctx)
	hold := func() (string, error) {
		sleep(ctx, s.Hold)
		return in.clientsLeft(ctx, down, start, before)
	}
	switch s.Kind {
	case chaos.FaultNodeKill, chaos.FaultNodeKillLeader:
		inc := n.p.kill()
		if inc == nil {
			return fmt.Errorf("node %s was not running", n.name)
		}
		moved, err := hold()
		if s.Kind == chaos.FaultNodeKillLeader {
			f.Measures = map[string]float64{chaos.MeasureLeaderOnDownNode: rc.leaderOnDownNode(ctx, in.c.vhost, n)}
		}
		if err := errors.Join(err, n.awaitStartup(healCtx)); err != nil {
			return err
		}
		record(fmt.Sprintf("%s%s SIGKILL #%d, down %v, restarted; %s", n.name, extra, inc.n, time.Since(start).Round(100*time.Millisecond), moved))
	case chaos.FaultNodeAppRestart:
		err := rc.stopApp(ctx, n)
		moved, left := hold()
		if err := errors.Join(err, left, rc.startApp(healCtx, n)); err != nil {
			return err
		}
		record(n.name + " rabbitmqctl stop_app, start_app; " + moved)
	case chaos.FaultNodeProxyDown:
		names := []string{nodeProxy(chaos.TargetAMQPOrders, n.i), nodeProxy(chaos.TargetAMQPShipping, n.i)}
		var errs []error
		for _, name := range names {
			errs = append(errs, in.c.toxi.disable(name))
		}
		moved, left := hold()
		for _, name := range names {
			errs = append(errs, in.c.toxi.enable(name))
		}
		if err := errors.Join(append(errs, left)...); err != nil {
			return err
		}
		record(n.name + " cut away from the clients (its proxies disabled); " + moved)
	case chaos.FaultNodeMajorityDown:
		var killed []string
		for _, d := range down {
			if inc := d.p.kill(); inc != nil {
				killed = append(killed, fmt.Sprintf("%s #%d", d.name, inc.n))
			}
		}
		lostFrom := time.Since(f.Start)
		pending := in.c.pendingCount(ctx)
		// The survivor sees a minority and pauses itself (pause_minority):
		// no node accepts clients until the others are back, so there is
		// nowhere to reconnect to, and nothing to list connections with.
		paused := n.waitRunning(ctx, false)
		sleep(ctx, s.Hold)
		pendingEnd := in.c.pendingCount(ctx)
		f.Measures = map[string]float64{chaos.MeasureQuorumLostFrom: lostFrom.Seconds(), chaos.MeasureQuorumLostTo: time.Since(f.Start).Seconds()}
		errs := []error{paused}
		var mu sync.Mutex
		var wg sync.WaitGroup
		for _, d := range down {
			wg.Go(func() {
				err := d.awaitStartup(healCtx)
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
		record(fmt.Sprintf("majority lost: %s SIGKILLed at once, %s paused itself (pause_minority) for %v (outbox pending %s -> %s), all restarted",
			strings.Join(killed, " and "), n.name, time.Since(start).Round(100*time.Millisecond), pending, pendingEnd))
	case chaos.FaultNodeWipe:
		return in.wipeNode(ctx, s, n, start, before, record)
	case chaos.FaultNodePartition:
		leaderBefore, _ := rc.leader(ctx, in.c.vhost, mainQueue)
		var moved string
		how, err := rc.partitionNode(ctx, n, func() error {
			sleep(ctx, s.Hold)
			f.Measures = map[string]float64{chaos.MeasureLeaderOnDownNode: rc.leaderOnDownNode(ctx, in.c.vhost, n)}
			var err error
			moved, err = in.clientsLeft(ctx, down, start, before)
			return err
		})
		if err != nil {
			return err
		}
		leaderAfter, _ := rc.leader(healCtx, in.c.vhost, mainQueue)
		record(fmt.Sprintf("%s cut from the other nodes (blackhole routes between their namespaces): %s; leader of %s %s before, %s after; %s",
			n.name, how, mainQueue, leaderBefore, leaderAfter, moved))
	default:
		return fmt.Errorf("not a node fault: %s", s.Kind)
	}
	return nil
}

// wipeNode kills n, wipes its data directory, makes the cluster forget it
// (forget_cluster_node, from a node still up: it also drops n from every
// quorum queue's members), starts it empty (a cluster of its own), joins it
// to the others again (stop_app, reset, join_cluster, start_app) and makes
// it a member of every quorum queue of the run again (rabbitmq-queues
// grow). Its proxies stay disabled until it has joined: a client reaching
// the empty node would find no vhost. The run's queues must then have
// members on all three nodes again.
func (in *injector) wipeNode(ctx context.Context, s chaos.Step, n *rabbitNode, start time.Time, before []brokerConn, record func(string)) error {
	rc := in.c.rabbit
	healCtx := context.WithoutCancel(ctx)
	proxies := []string{nodeProxy(chaos.TargetAMQPOrders, n.i), nodeProxy(chaos.TargetAMQPShipping, n.i)}
	var errs []error
	for _, name := range proxies {
		errs = append(errs, in.c.toxi.disable(name))
	}
	defer func() {
		for _, name := range proxies {
			if err := in.c.toxi.enable(name); err != nil {
				in.logf("fault %v: enable %s: %v", s, name, err)
			}
		}
	}()
	if n.p.kill() == nil {
		return fmt.Errorf("node %s was not running", n.name)
	}
	moved, left := in.clientsLeft(ctx, []*rabbitNode{n}, start, before)
	errs = append(errs, left)
	var survivor *rabbitNode
	for _, o := range rc.nodes {
		if o != n && o.p.current() != nil {
			survivor = o
			break
		}
	}
	if survivor == nil {
		return errors.Join(append(errs, fmt.Errorf("wipe %s: no other node up", n.name))...)
	}
	if _, err := survivor.ctl(healCtx, "forget_cluster_node", n.name); err != nil {
		errs = append(errs, err)
	}
	if err := wipeDir(filepath.Join(n.node.Dir, "data"), int(n.node.Cred.Uid), int(n.node.Cred.Gid)); err != nil {
		errs = append(errs, err)
	}
	sleep(ctx, s.Hold)
	errs = append(errs, n.awaitStartup(healCtx))
	for _, args := range [][]string{{"stop_app"}, {"reset"}, {"join_cluster", survivor.name}, {"start_app"}} {
		if err := errors.Join(errs...); err != nil {
			break
		}
		_, err := n.ctl(healCtx, args...)
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := n.awaitStartup(healCtx); err != nil {
		return err
	}
	if _, err := survivor.cli(healCtx, "rabbitmq-queues", "grow", n.name, "all",
		"--vhost-pattern", "^"+regexp.QuoteMeta(in.c.vhost)+"$", "--queue-pattern", ".*"); err != nil {
		return err
	}
	members, err := rc.checkQuorumQueues(healCtx, in.c.vhost)
	if err != nil {
		return fmt.Errorf("after %s rejoined with a wiped data directory: %w", n.name, err)
	}
	record(fmt.Sprintf("%s killed, data directory wiped, forgotten by %s, started empty, joined again and grown into every quorum queue in %v; %s; %s",
		n.name, survivor.name, time.Since(start).Round(100*time.Millisecond), moved, members))
	return nil
}

// wipeDir empties dir and gives it back to uid:gid.
func wipeDir(dir string, uid, gid int) error {
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("wipe %s: %w", dir, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("wipe %s: %w", dir, err)
	}
	if err := os.Chown(dir, uid, gid); err != nil {
		return fmt.Errorf("wipe %s: %w", dir, err)
	}
	return nil
}

// brokerConn is one client connection of the run, as its node lists it.
type brokerConn struct {
	node        string // chaos.NodeName of the node it is on
	name        string // the client's connection name ("" when none)
	state       string // running, blocking, blocked, flow...
	connectedAt time.Time
}

// localConnectionsExpr prints the connections of one node, one a line:
// vhost, connected_at (ms), connection name, state.
const localConnectionsExpr = `[case catch rabbit_networking:connection_info(P, [vhost, connected_at, client_properties, state]) of
	[{vhost, VH}, {connected_at, At}, {client_properties, CP}, {state, S}] ->
		N = case lists:keyfind(<<"connection_name">>, 1, CP) of {_, _, Name} -> Name; false -> <<>> end,
		io:format("~s\t~p\t~s\t~s~n", [VH, At, N, S]);
	_ -> ok
end || P <- rabbit_networking:local_connections()], ok.`

// connections lists the run's client connections (the services', not the
// publish-order tap's), asking each node that
// answers for its own (rabbit_networking:local_connections):
// rabbitmqctl list_connections streams the other nodes' answers straight
// to the CLI's Erlang node, which nodes in namespaces cannot reach, and
// timed out. A node that does not answer (down, paused, app stopped) has
// none listed.
func (rc *rabbitCluster) connections(ctx context.Context, vhost string) ([]brokerConn, error) {
	var conns []brokerConn
	answered := 0
	for _, n := range rc.nodes {
		if n.p.current() == nil {
			continue
		}
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		out, err := n.ctl(ctx, "eval", localConnectionsExpr)
		cancel()
		if err != nil {
			continue
		}
		answered++
		for line := range strings.SplitSeq(out, "\n") {
			f := strings.Split(strings.TrimSpace(line), "\t")
			if len(f) != 4 || f[0] != vhost || f[2] == publishTapConnName {
				continue // the harness's tap, straight to a node, is no client under test
			}
			c := brokerConn{node: chaos.NodeName(n.i), name: f[2], state: f[3]}
			if ms, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				c.connectedAt = time.UnixMilli(ms)
			}
			conns = append(conns, c)
		}
	}
	if answered == 0 {
		return nil, errors.New("list connections: no node answered")
	}
	return conns, nil
}

// clientsLeft waits until every client that had a connection on a down node
// (before, listed just before the fault) has left it: no connection of the
// run listed on a down node, and each client name with at least as many
// connections made since start on the nodes still up as it had on the down
// ones. A shipping process's publisher connection ("…-publisher") opens
// only when it has something to republish: it must have left, not
// necessarily come back. It says where each client went, or why one never
// left, after a minute and a half.
func (in *injector) clientsLeft(ctx context.Context, down []*rabbitNode, start time.Time, before []brokerConn) (string, error) {
	rc := in.c.rabbit
	isDown := make(map[string]bool)
	for _, d := range down {
		isDown[chaos.NodeName(d.i)] = true
	}
	had := make(map[string]int)
	for _, c := range before {
		if isDown[c.node] && !strings.HasSuffix(c.name, "-publisher") {
			had[c.name]++
		}
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		conns, err := rc.connections(ctx, in.c.vhost)
		var stuck []string
		moved := make(map[string][]string)
		for _, c := range conns {
			switch {
			case isDown[c.node]:
				stuck = append(stuck, cmpName(c.name)+" on "+c.node)
			case !c.connectedAt.Before(start.Truncate(time.Millisecond)):
				moved[c.name] = append(moved[c.name], c.node)
			}
		}
		var missing []string
		for name, k := range had {
			if len(moved[name]) < k {
				missing = append(missing, fmt.Sprintf("%s (%d of %d reconnected)", cmpName(name), len(moved[name]), k))
			}
		}
		if err == nil && len(stuck) == 0 && len(missing) == 0 {
			return describeMoves(moved), nil
		}
		if ctx.Err() != nil {
			return "clients not checked: the run ended", nil
		}
		if time.Now().After(deadline) {
			slices.Sort(stuck)
			slices.Sort(missing)
			return "", fmt.Errorf("clients never left the down nodes: still there: %v; not reconnected elsewhere: %v (list error: %v)", stuck, missing, err)
		}
		sleep(ctx, time.Second)
	}
}

func cmpName(name string) string {
	if name == "" {
		return "(unnamed)"
	}
	return name
}

// describeMoves says which node each client reconnected to.
func describeMoves(moved map[string][]string) string {
	if len(moved) == 0 {
		return "no client had to move"
	}
	var parts []string
	for name, nodes := range moved {
		slices.Sort(nodes)
		parts = append(parts, cmpName(name)+" -> "+strings.Join(nodes, ","))
	}
	slices.Sort(parts)
	return "clients reconnected: " + strings.Join(parts, "; ")
}

// shippingQueues are the queues shipping declares, all quorum queues.
var shippingQueues = []string{mainQueue, delayQueue, deadLetterQueue}

// checkQuorumQueues asserts that each of shipping's queues in vhost is a
// quorum queue with a member on every node of the cluster and a leader
// among them, and says where each leader is.
func (rc *rabbitCluster) checkQuorumQueues(ctx context.Context, vhost string) (string, error) {
	deadline := time.Now().Add(3 * time.Minute)
	for {
		// A queue that does not answer yet is not listed: asked again.
		out, err := rc.checkQuorumQueuesOnce(ctx, vhost)
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return out, err
		}
		sleep(ctx, 3*time.Second)
	}
}

func (rc *rabbitCluster) checkQuorumQueuesOnce(ctx context.Context, vhost string) (string, error) {
	states, err := rc.queueStates(ctx, vhost, shippingQueues...)
	if err != nil {
		return "", err
	}
	var errs []error
	var parts []string
	for _, q := range shippingQueues {
		st, ok := states[q]
		if !ok {
			errs = append(errs, fmt.Errorf("queue %s of vhost %s not declared or not answering", q, vhost))
			continue
		}
		if st.typ != "quorum" {
			errs = append(errs, fmt.Errorf("queue %s is %s, want quorum", q, st.typ))
		}
		var missing []string
		for _, n := range rc.nodes {
			if !slices.Contains(st.members, n.name) {
				missing = append(missing, n.name)
			}
		}
		if len(missing) > 0 {
			errs = append(errs, fmt.Errorf("queue %s: members %v miss %v", q, st.members, missing))
		}
		leader := ""
		for _, n := range rc.nodes {
			if n.name == st.leader {
				leader = chaos.NodeName(n.i)
			}
		}
		if leader == "" {
			errs = append(errs, fmt.Errorf("queue %s: leader %q is none of the nodes", q, st.leader))
		}
		parts = append(parts, fmt.Sprintf("%s leader %s", q, leader))
	}
	if err := errors.Join(errs...); err != nil {
		return "", err
	}
	return fmt.Sprintf("quorum queues with members on all %d nodes: %s", len(rc.nodes), strings.Join(parts, ", ")), nil
}

// pendingCount says how many events wait in the outbox, or why it is not
// known.
func (c *cluster) pendingCount(ctx context.Context) string {
	var n int
	if err := c.db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE dead_lettered_at IS NULL`).Scan(&n); err != nil {
		return "unknown"
	}
	return strconv.Itoa(n)
}

// execOutput runs a command to completion and returns what it printed.
func execOutput(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	return string(out), err
}

// assertQuorumQueues fails the test unless shipping's queues are quorum
// queues with members on every node of the run's cluster (three nodes or
// more), and logs where their leaders are; when says at which point of the
// run.
func (c *cluster) assertQuorumQueues(ctx context.Context, when string) {
	c.t.Helper()
	if c.rabbit == nil || len(c.rabbit.nodes) < 3 {
		return
	}
	out, err := c.rabbit.checkQuorumQueues(ctx, c.vhost)
	if err != nil {
		c.t.Errorf("shipping's queues %s: %v", when, err)
		return
	}
	c.t.Logf("shipping's queues %s: %s", when, out)
}

// queueState is one queue as its Raft group sees it.
type queueState struct {
	typ      string   // "quorum", or the queue type's module for another
	leader   string   // Erlang node name
	members  []string // Erlang node names
	messages int      // ready and unacknowledged
}

// queueStates reads queues of vhost from the cluster: the type from the
// queue's record, leader and members from its Raft group (ra:members, on the
// node asked), the message count from the leader's node (only there is it
// kept). rabbitmqctl list_queues
// is not used: the other nodes send their part of its answer straight to
// the CLI's Erlang node, which nodes in namespaces cannot reach, and it
// timed out ("some queue(s) are unresponsive").
// A queue missing from the answer is not declared or not answering.
func (rc *rabbitCluster) queueStates(ctx context.Context, vhost string, queues ...string) (map[string]queueState, error) {
	return queueStatesVia(ctx, rc.ctl, vhost, queues...)
}

// queueStatesVia is queueStates asking through ctl (one node's rabbitmqctl,
// or the cluster's first that answers).
func queueStatesVia(ctx context.Context, ctl func(context.Context, ...string) (string, error), vhost string, queues ...string) (map[string]queueState, error) {
	var names []string
	for _, q := range queues {
		names = append(names, fmt.Sprintf("<<%q>>", q))
	}
	expr := fmt.Sprintf(`[case rabbit_amqqueue:lookup(rabbit_misc:r(<<%q>>, queue, N)) of
		{ok, Q} ->
			T = case amqqueue:get_type(Q) of rabbit_quorum_queue -> quorum; Other -> Other end,
			{R, _} = amqqueue:get_pid(Q),
			case catch ra:members({R, node()}, 5000) of
				{ok, Ms, {_, L}} ->
					[{messages, C}] = rpc:call(L, rabbit_amqqueue, info, [Q, [messages]], 15000),
					io:format("~s\t~s\t~s\t~s\t~p~n", [N, T, L, string:join([atom_to_list(X) || {_, X} <- Ms], ","), C]);
				_ -> ok
			end;
		_ -> ok
	end || N <- [%s]], ok.`, vhost, strings.Join(names, ", "))
	out, err := ctl(ctx, "eval", expr)
	if err != nil {
		return nil, err
	}
	states := make(map[string]queueState)
	for line := range strings.SplitSeq(out, "\n") {
		f := strings.Split(strings.TrimSpace(line), "\t")
		if len(f) != 5 {
			continue
		}
		n, _ := strconv.Atoi(f[4])
		states[f[0]] = queueState{typ: f[1], leader: f[2], members: strings.Split(f[3], ","), messages: n}
	}
	return states, nil
}

// leaderOnDownNode reads the leader of shipping's queue from the nodes other
// than down, while down is killed or cut away, for
// chaos.MeasureLeaderOnDownNode: 1 when it is still down, 0 when another
// node leads, -1 when no other node could tell within 30 seconds.
func (rc *rabbitCluster) leaderOnDownNode(ctx context.Context, vhost string, down *rabbitNode) float64 {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		for _, o := range rc.nodes {
			if o == down {
				continue
			}
			states, err := queueStatesVia(ctx, o.ctl, vhost, mainQueue)
			st, ok := states[mainQueue]
			if err != nil || !ok {
				continue
			}
			if st.leader == down.name {
				return 1
			}
			return 0
		}
		sleep(ctx, 2*time.Second)
	}
	return -1
}

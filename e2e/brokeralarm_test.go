package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// ownBroker gives a profile with a fault of chaos.OwnBrokerFaultKinds (the
// long one) a RabbitMQ node of the run's own (topology Nodes=1, the same
// harness as the cluster profile's three nodes): a resource alarm blocks
// every publisher of the broker it is set on, so it is never set on the
// machine's broker. CHAOS_OWN_BROKER=false, or a machine where no node of
// the run's own can run, keeps the machine's broker and leaves those faults
// out (skips says why). A cluster run keeps its three nodes.
func ownBroker(t *testing.T, skips *kindSkips, p chaos.Profile, topo chaos.Topology) (chaos.Profile, chaos.Topology) {
	t.Helper()
	if topo.Nodes > 0 || !slices.ContainsFunc(p.Kinds, func(k chaos.FaultKind) bool { return slices.Contains(chaos.OwnBrokerFaultKinds, k) }) {
		return p, topo
	}
	err := rabbitClusterAvailable()
	if os.Getenv("CHAOS_OWN_BROKER") == "false" {
		err = errors.New("CHAOS_OWN_BROKER=false")
	}
	if err != nil {
		t.Logf("rabbitmq: the machine's broker")
		return skips.without(p, "CHAOS_OWN_BROKER", fmt.Errorf("no RabbitMQ node of the run's own: %w", err), chaos.OwnBrokerFaultKinds...), topo
	}
	t.Logf("rabbitmq: a node of the run's own (internal/rabbitnode), for %v; the machine's broker is not used", chaos.OwnBrokerFaultKinds)
	topo.Nodes = 1
	return p, topo
}

// brokerAlarm sets a resource alarm on the target node of the run's own
// broker for s.Hold: its memory high watermark lowered below what it uses,
// or (for about half the steps, by the plan's time) its disk free limit raised above
// the free space. The broker then blocks every publishing connection (on a
// cluster, on every node). What it proves, besides the checker's
// invariants once the alarm clears:
//
//   - the alarm took: the node reports it, and the run's connections are
//     listed blocked or blocking;
//   - the relays wait: no outbox row gains more than two attempts while
//     publishing is blocked (a relay that took the block for a failure and
//     retried would count one per backoff);
//   - shipping's workers do not freeze: shipping is cut from the broker for
//     a few seconds first, so a backlog waits in its queue, and is let back
//     once the alarm holds; it must apply events from that backlog while
//     the alarm still holds (its own publisher connection, for deferrals
//     and dead letters, is blocked meanwhile). With no backlog (no load at
//     that moment) the detail says so.
//
// The alarm is cleared by a deferred restore whatever happens.
func (in *injector) brokerAlarm(ctx context.Context, s chaos.Step, record func(string)) error {
	rc := in.c.rabbit
	if rc == nil {
		return errors.New("broker_alarm needs a broker of the run's own; never on the machine's broker")
	}
	n, err := rc.node(s.Target)
	if err != nil {
		return err
	}
	// The step holds the proxies, PostgreSQL and MongoDB too (see
	// injector.resources): no other fault cuts what the check below reads.
	healCtx := context.WithoutCancel(ctx)

	disk := (s.At/(100*time.Millisecond))%2 == 1
	set, restore, err := alarmCommands(ctx, n, disk)
	if err != nil {
		return err
	}

	// A backlog for shipping: cut it from the broker while the relays go on.
	shipProxies := in.c.proxies(chaos.TargetAMQPShipping)
	var errs []error
	for _, name := range shipProxies {
		errs = append(errs, in.c.toxi.disable(name))
	}
	sleep(ctx, 3*time.Second)

	if _, err := n.ctl(ctx, set...); err != nil {
		errs = append(errs, err)
	}
	defer func() {
		if _, err := n.ctl(healCtx, restore...); err != nil {
			in.logf("fault %s: restore %v: %v", s.Kind, restore, err)
		}
	}()
	alarmed := waitAlarm(ctx, n, true)
	for _, name := range shipProxies {
		errs = append(errs, in.c.toxi.enable(name))
	}
	if err := errors.Join(append(errs, alarmed)...); err != nil {
		return err
	}
	start := time.Now()
	backlog, _ := readyCounts(ctx, in.c.amqpURL, mainQueue)
	appliedAtStart, err := in.c.appliedCount(ctx)
	if err != nil {
		return err
	}
	attemptsAtStart, err := in.c.outboxAttempts(ctx)
	if err != nil {
		return err
	}

	// Hold: the connections are blocked, and shipping applies from its
	// backlog. A shipping process killed by another fault at the same time
	// may need longer: up to a minute more before it counts as frozen.
	var blocked int
	var applied int64
	deadline := start.Add(s.Hold + time.Minute)
	for {
		if b, err := in.c.blockedConnections(ctx, rc); err == nil {
			blocked = max(blocked, b)
		}
		if a, err := in.c.appliedCount(ctx); err == nil {
			applied = a - appliedAtStart
		}
		held := time.Since(start) >= s.Hold
		if ctx.Err() != nil || held && (blocked > 0 && (applied > 0 || backlog[mainQueue] == 0) || time.Now().After(deadline)) {
			break
		}
		sleep(ctx, 500*time.Millisecond)
	}
	attemptsAtEnd, err := in.c.outboxAttempts(ctx)
	if err != nil {
		return err
	}
	var burned []string
	for id, a := range attemptsAtEnd {
		if before, ok := attemptsAtStart[id]; ok && a-before > 2 {
			burned = append(burned, fmt.Sprintf("row %d: %d -> %d", id, before, a))
		}
	}
	if _, err := n.ctl(healCtx, restore...); err != nil {
		return err
	}
	if err := waitAlarm(healCtx, n, false); err != nil {
		return err
	}
	held := time.Since(start).Round(100 * time.Millisecond)
	what := "memory watermark"
	if disk {
		what = "disk free limit"
	}
	detail := fmt.Sprintf("%s alarm on %s for %v: %d connections of the run blocked or blocking; shipping applied %d events from a backlog of %d ready; no row gained more than 2 attempts",
		what, n.name, held, blocked, applied, backlog[mainQueue])
	switch {
	case ctx.Err() != nil:
		return nil
	case blocked == 0:
		return fmt.Errorf("%s alarm on %s: no connection of the run listed blocked or blocking in %v", what, n.name, held)
	case backlog[mainQueue] > 0 && applied == 0:
		return fmt.Errorf("%s alarm on %s: shipping applied nothing in %v with %d messages ready: its workers froze on a blocked connection", what, n.name, held, backlog[mainQueue])
	case len(burned) > 0:
		return fmt.Errorf("%s alarm on %s: relays burned attempts while publishing was blocked: %s", what, n.name, strings.Join(burned, ", "))
	}
	record(detail)
	return nil
}

// alarmCommands returns the rabbitmqctl arguments that set a memory alarm
// (or a disk alarm) on n, and those that restore the node's own setting,
// read from it first.
func alarmCommands(ctx context.Context, n *rabbitNode, disk bool) (set, restore []string, err error) {
	if disk {
		out, err := n.ctl(ctx, "eval", "rabbit_disk_monitor:get_disk_free_limit().")
		if err != nil {
			return nil, nil, err
		}
		limit, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
		if err != nil {
			return nil, nil, fmt.Errorf("disk free limit of %s: %q: %w", n.name, out, err)
		}
		// A petabyte free: more than any disk here has.
		return []string{"set_disk_free_limit", "1000000000000000"}, []string{"set_disk_free_limit", strconv.FormatInt(limit, 10)}, nil
	}
	out, err := n.ctl(ctx, "eval", "vm_memory_monitor:get_vm_memory_high_watermark().")
	if err != nil {
		return nil, nil, err
	}
	mark := strings.TrimSpace(out)
	if _, err := strconv.ParseFloat(mark, 64); err != nil {
		return nil, nil, fmt.Errorf("memory high watermark of %s: %q, want a fraction: %w", n.name, out, err)
	}
	return []string{"set_vm_memory_high_watermark", "0.0000001"}, []string{"set_vm_memory_high_watermark", mark}, nil
}

// waitAlarm waits (at most a minute) until n reports a resource alarm, or
// none when on is false.
func waitAlarm(ctx context.Context, n *rabbitNode, on bool) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		out, err := n.ctl(ctx, "eval", "rabbit_alarm:get_alarms().")
		if err == nil && strings.Contains(out, "resource_limit") == on {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: resource alarm still %v after a minute: %q, %v", n.name, !on, strings.TrimSpace(out), err)
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// blockedConnections counts the run's connections the broker lists as
// blocked (it published under the alarm) or blocking (it would be).
func (c *cluster) blockedConnections(ctx context.Context, rc *rabbitCluster) (int, error) {
	conns, err := rc.connections(ctx, c.vhost)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, conn := range conns {
		if conn.state == "blocked" || conn.state == "blocking" {
			n++
		}
	}
	return n, nil
}

// appliedCount counts the events shipping recorded in MongoDB.
func (c *cluster) appliedCount(ctx context.Context) (int64, error) {
	client, err := mongo.Connect(options.Client().ApplyURI("mongodb://" + c.mongo.addr() + "/" + c.mongo.uriQuery()).
		SetServerSelectionTimeout(10 * time.Second))
	if err != nil {
		return 0, fmt.Errorf("count applied events: %w", err)
	}
	defer func() { _ = client.Disconnect(context.WithoutCancel(ctx)) }()
	n, err := client.Database(c.id).Collection(shipmentsCollection).CountDocuments(ctx, bson.D{})
	if err != nil {
		return 0, fmt.Errorf("count applied events: %w", err)
	}
	return n, nil
}

// outboxAttempts reads the attempts of every row still in the outbox.
func (c *cluster) outboxAttempts(ctx context.Context) (map[int64]int, error) {
	rows, err := c.db.Query(ctx, `SELECT id, attempts FROM outbox`)
	if err != nil {
		return nil, fmt.Errorf("read outbox attempts: %w", err)
	}
	defer rows.Close()
	out := make(map[int64]int)
	for rows.Next() {
		var id int64
		var a int
		if err := rows.Scan(&id, &a); err != nil {
			return nil, fmt.Errorf("read outbox attempts: %w", err)
		}
		out[id] = a
	}
	return out, rows.Err()
}

// ownBrokerAppRestart is the broker app restart on the run's own broker:
// stop_app and start_app of each of its nodes (one at a time on a cluster).
func (in *injector) ownBrokerAppRestart(ctx context.Context, s chaos.Step, record func(string)) error {
	rc := in.c.rabbit
	for _, n := range rc.nodes {
		err := rc.stopApp(ctx, n)
		sleep(ctx, s.Hold)
		if err := errors.Join(err, rc.startApp(context.WithoutCancel(ctx), n)); err != nil {
			return err
		}
	}
	record("rabbitmqctl stop_app, start_app on the run's own broker (" + strings.Join(rc.names(), ", ") + ")")
	return nil
}

// TestChaosBrokerAlarm runs the flow on a RabbitMQ node of the run's own
// with resource alarms (memory and disk, see brokerAlarm) and a shipping
// kill among them, for 50 seconds of load: the relays wait while
// publishing is blocked, shipping keeps applying its backlog, and the
// checker's invariants hold once the alarms clear. It needs root and the
// rabbitmq user (internal/rabbitnode); make chaos has the same fault in its
// long profile.
func TestChaosBrokerAlarm(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos suite takes minutes; not run with -short")
	}
	if err := rabbitClusterAvailable(); err != nil {
		unavailable(t, "no RabbitMQ node of the run's own for the broker alarm: %v", err)
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
		Name: "broker_alarm", Load: 50 * time.Second, Warmup: 5 * time.Second, Cooldown: 8 * time.Second,
		Clients: 3, Rate: 15, CancelRatio: 0.4,
		Kinds: []chaos.FaultKind{chaos.FaultBrokerAlarm, chaos.FaultKillShipping}, Faults: 4,
		HoldMin: 4 * time.Second, HoldMax: 8 * time.Second, DrainBudget: 2 * time.Minute,
	}
	topo := chaos.Topology{Relays: 2, Consumers: 2, Nodes: 1}
	plan, err := chaos.NewPlan(seed, profile, topo)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range plan {
		t.Logf("plan: %v", s)
	}
	report := runScenario(t, scenario{seed: seed, profile: profile, plan: plan, provider: provider, topo: topo, pgBinDir: pgBinDir, pgCred: pgCred})
	t.Log(report.Summary())
	if report.FaultsInjected[chaos.FaultBrokerAlarm] == 0 {
		t.Errorf("no broker alarm injected: %v", report.FaultsInjected)
	}
	for _, v := range report.Violations {
		t.Errorf("violation: %v", v)
	}
}

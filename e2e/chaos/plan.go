package chaos

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-inbox/reference/internal/crashpoint"
)

// FaultKind names a kind of fault. The report counts injected faults by kind.
type FaultKind string

// The fault catalogue of docs/guarantees.md, as this suite injects it.
const (
	// SIGKILL of a process, restarted after a pause.
	FaultKillOrders   FaultKind = "kill_orders"
	FaultKillRelay    FaultKind = "kill_relay"
	FaultKillShipping FaultKind = "kill_shipping"

	// The process is restarted with CRASH_POINT armed and kills itself there.
	FaultCrashOrdersAfterCommit   FaultKind = "crash_point:" + crashpoint.OrdersAfterCommitBeforeResponse
	FaultCrashRelayAfterPublish   FaultKind = "crash_point:" + crashpoint.RelayAfterPublishBeforeMark
	FaultCrashShippingAfterEffect FaultKind = "crash_point:" + crashpoint.ShippingAfterEffectBeforeInbox
	FaultCrashShippingAfterInbox  FaultKind = "crash_point:" + crashpoint.ShippingAfterInboxBeforeAck

	// Toxiproxy between the services and RabbitMQ.
	FaultBrokerProxyDown      FaultKind = "broker_proxy_down"       // proxy disabled: connections cut, new ones refused
	FaultBrokerProxyResetPeer FaultKind = "broker_proxy_reset_peer" // TCP RST on the next bytes
	FaultBrokerProxyLatency   FaultKind = "broker_proxy_latency"    // every frame delayed
	FaultBrokerProxyTimeout   FaultKind = "broker_proxy_timeout"    // bytes swallowed, connections hang
	// The broker closes every connection of the run's vhost.
	FaultBrokerCloseConnections FaultKind = "broker_close_connections"
	// rabbitmqctl stop_app / start_app: the whole broker goes down. It hits
	// every test that uses the broker at the time, so only the long profile
	// (or CHAOS_BROKER_RESTART=true) has it.
	FaultBrokerAppRestart FaultKind = "broker_app_restart"

	// pg_terminate_backend of every session on the run's database.
	FaultPostgresKillSessions FaultKind = "postgres_kill_sessions"
	// The run's own PostgreSQL cluster stopped immediately (pg_ctl -m
	// immediate: no checkpoint, crash recovery at the next start), then
	// started again.
	FaultPostgresRestart FaultKind = "postgres_restart"

	// The embedded FerretDB process is stopped, then started again on the same
	// address and data.
	FaultMongoRestart FaultKind = "mongo_restart"
	// Toxiproxy between shipping and MongoDB disabled.
	FaultMongoProxyDown FaultKind = "mongo_proxy_down"

	// Poison messages published straight to the exchange.
	FaultPoisonMalformed        FaultKind = "poison:" + FaultKind(PoisonMalformed)
	FaultPoisonMissingMessageID FaultKind = "poison:" + FaultKind(PoisonMissingMessageID)
	FaultPoisonUnknownType      FaultKind = "poison:" + FaultKind(PoisonUnknownType)
	FaultPoisonOversize         FaultKind = "poison:" + FaultKind(PoisonOversize)

	// Node faults of the cluster profile, on a RabbitMQ cluster of the run's
	// own (three nodes, quorum queues replicated on each): SIGKILL of a node,
	// restarted after a pause; the same on the node leading shipping's queue;
	// rabbitmqctl stop_app / start_app of a node; a node cut away from every
	// client (its proxies disabled) while the nodes still see each other.
	FaultNodeKill       FaultKind = "node_kill"
	FaultNodeKillLeader FaultKind = "node_kill_leader"
	FaultNodeAppRestart FaultKind = "node_app_restart"
	FaultNodeProxyDown  FaultKind = "node_proxy_down"
	// Two nodes of three SIGKILLed at once (the majority lost: quorum
	// queues stop), restarted after a pause; the target is the survivor.
	FaultNodeMajorityDown FaultKind = "node_majority_down"
	// A node killed, its data directory wiped, forgotten by the cluster
	// (forget_cluster_node), started empty, joined again and made a member
	// of every quorum queue again (rabbitmq-queues grow).
	FaultNodeWipe FaultKind = "node_wipe"
	// The target cut from the other nodes (not from the clients) by a
	// network partition between their namespaces: with pause_minority it
	// pauses itself until the partition heals.
	FaultNodePartition FaultKind = "node_partition"

	// A resource alarm on a node of the run's own broker (memory watermark
	// or disk free limit crossed): the broker blocks every publishing
	// connection until it clears. Never on the machine's broker.
	FaultBrokerAlarm FaultKind = "broker_alarm"
)

// OwnBrokerFaultKinds need a broker of the run's own (one node or the
// cluster): they would block every user of the machine's broker.
var OwnBrokerFaultKinds = []FaultKind{FaultBrokerAlarm}

// ClusterFaultKinds are the node faults, which only the cluster profile has.
var ClusterFaultKinds = []FaultKind{FaultNodeKill, FaultNodeKillLeader, FaultNodeAppRestart, FaultNodeProxyDown,
	FaultNodeMajorityDown, FaultNodeWipe, FaultNodePartition}

// AllFaultKinds lists every kind, in a stable order.
var AllFaultKinds = []FaultKind{
	FaultKillOrders, FaultKillRelay, FaultKillShipping,
	FaultCrashOrdersAfterCommit, FaultCrashRelayAfterPublish,
	FaultCrashShippingAfterEffect, FaultCrashShippingAfterInbox,
	FaultBrokerProxyDown, FaultBrokerProxyResetPeer, FaultBrokerProxyLatency, FaultBrokerProxyTimeout,
	FaultBrokerCloseConnections, FaultBrokerAppRestart,
	FaultPostgresKillSessions, FaultPostgresRestart,
	FaultMongoRestart, FaultMongoProxyDown,
	FaultPoisonMalformed, FaultPoisonMissingMessageID, FaultPoisonUnknownType, FaultPoisonOversize,
}

// CrashPoint returns the crash point a crash_point kind arms, and false for
// other kinds.
func (k FaultKind) CrashPoint() (string, bool) {
	return strings.CutPrefix(string(k), "crash_point:")
}

// PoisonKind returns the poison a poison kind publishes, and false for other
// kinds.
func (k FaultKind) PoisonKind() (PoisonKind, bool) {
	p, ok := strings.CutPrefix(string(k), "poison:")
	return PoisonKind(p), ok
}

// Instant tells whether a fault is over once injected (a kill, a poison
// message, a session kill), as opposed to an outage held for a while.
func (k FaultKind) Instant() bool {
	if resourceFault(k) {
		return false
	}
	switch k {
	case FaultBrokerProxyDown, FaultBrokerProxyResetPeer, FaultBrokerProxyLatency, FaultBrokerProxyTimeout,
		FaultBrokerAppRestart, FaultPostgresRestart, FaultMongoRestart, FaultMongoProxyDown,
		FaultNodeKill, FaultNodeKillLeader, FaultNodeAppRestart, FaultNodeProxyDown,
		FaultPostgresFailover, FaultPostgresSyncStall,
		FaultNodeMajorityDown, FaultNodeWipe, FaultNodePartition, FaultBrokerAlarm:
		return false
	}
	if slices.Contains(PauseAndPathFaultKinds, k) {
		return false
	}
	_, crash := k.CrashPoint()
	return !crash
}

// Profile sizes a run.
type Profile struct {
	// Name is "short", "long" or "cluster", for the report.
	Name string
	// Load is how long the workload runs. Faults start after Warmup and end
	// by Load-Cooldown.
	Load     time.Duration
	Warmup   time.Duration
	Cooldown time.Duration
	// Clients is the number of concurrent workload clients.
	Clients int
	// Rate bounds the creates per second over all clients.
	Rate float64
	// CancelRatio is the share of acknowledged orders the workload cancels.
	CancelRatio float64
	// AmendRatio is the share of acknowledged orders the workload amends
	// 4 to 18 times (WorkloadConfig.AmendRatio): orders of 5 to 20 versions.
	AmendRatio float64
	// Kinds are the fault kinds of the run; each is injected at least once.
	Kinds []FaultKind
	// Faults is the number of faults to schedule, at least len(Kinds).
	Faults int
	// Once are kinds of Kinds scheduled exactly once, never drawn for the
	// extra faults (relay_mass_kill: each adds thousands of events).
	Once []FaultKind
	// HoldMin and HoldMax bound how long an outage lasts, and how long a killed
	// process stays down.
	HoldMin, HoldMax time.Duration
	// PauseMin and PauseMax bound how long a pause (PauseFaultKinds) lasts:
	// longer than what it must outlast (the relays' lease, the WAL relay's
	// takeover; the harness checks it). A pause ends before the cooldown.
	PauseMin, PauseMax time.Duration
	// DrainBudget is invariant I5's bound on the time from the end of the last
	// fault to the moment every committed event has its effect.
	DrainBudget time.Duration
}

// ShortProfile is the run inside `make test`: every kind of AllFaultKinds but
// the broker app restart (which would disturb other packages' tests running
// at the same time against the same broker), the migration under load,
// the relay mass kill, the pauses of a relay and of a shipping consumer and
// the faults on the PostgreSQL path (ShortPauseAndPathKinds: they overlap the
// load, adding no phase), about one and a half minutes of load. The database
// failover and the synchronous stall are the long profile's.
func ShortProfile() Profile {
	kinds := slices.DeleteFunc(slices.Clone(AllFaultKinds), func(k FaultKind) bool { return k == FaultBrokerAppRestart })
	kinds = append(kinds, FaultMigrationUnderLoad, FaultRelayMassKill)
	kinds = append(kinds, ShortPauseAndPathKinds...)
	return Profile{
		Name: "short", Load: 80 * time.Second, Warmup: 4 * time.Second, Cooldown: 6 * time.Second,
		Clients: 4, Rate: 20, CancelRatio: 0.4, AmendRatio: 0.2,
		Kinds: kinds, Faults: len(kinds) + 6, Once: []FaultKind{FaultRelayMassKill},
		HoldMin: time.Second, HoldMax: 4 * time.Second,
		PauseMin: 9 * time.Second, PauseMax: 12 * time.Second,
		// Shipping on the embedded FerretDB ends the load thousands of
		// messages behind (6,659 once, with the inbox's version gate and
		// tallies) and drains them at 70 to 130 a second: 101 s that run.
		// Three minutes still fail a stall of minutes.
		DrainBudget: 3 * time.Minute,
	}
}

// LongProfile is the `make chaos` run: every kind, the broker app restart,
// the infrastructure faults (InfraFaultKinds, and the broker alarm on a
// broker node of the run's own, see OwnBrokerFaultKinds), the pauses and the
// faults on the PostgreSQL path (PauseAndPathFaultKinds) and the resource
// faults (ResourceFaultKinds) included, many
// faults over several minutes. Its rate is lower than the
// short profile's: a 3-minute trial at 30 orders/s left shipping (on
// FerretDB, on this shared 2-core machine) thousands of messages behind,
// draining at 10-25 messages/s, so the drain measured that backlog rather
// than recovery from the faults.
func LongProfile() Profile {
	return Profile{
		Name: "long", Load: 8 * time.Minute, Warmup: 5 * time.Second, Cooldown: 10 * time.Second,
		Clients: 4, Rate: 12, CancelRatio: 0.4, AmendRatio: 0.4,
		Kinds: slices.Concat(AllFaultKinds, InfraFaultKinds, OwnBrokerFaultKinds, PauseAndPathFaultKinds, ResourceFaultKinds), Faults: 150,
		Once:    []FaultKind{FaultRelayMassKill},
		HoldMin: time.Second, HoldMax: 10 * time.Second,
		// Up to 25 s: past shipping's AMQP heartbeat timeout too (10 s), so
		// that the broker gives a paused consumer's deliveries to the other.
		PauseMin: 9 * time.Second, PauseMax: 25 * time.Second,
		DrainBudget: 5 * time.Minute,
	}
}

// ClusterProfile is the `make chaos-cluster` run: the flow on a three-node
// RabbitMQ cluster of the run's own, with every node fault and every fault of
// the other profiles but the restart of this machine's broker (the run does
// not use it). Three more Erlang VMs share the machine, so the rate is lower
// and the drain budget generous: at 8 creates a second (with their chains,
// 42 events a second) shipping applied 16 a second under the faults and the
// backlog took 316 s to drain; the profile runs at half that.
func ClusterProfile() Profile {
	kinds := slices.DeleteFunc(slices.Clone(AllFaultKinds), func(k FaultKind) bool { return k == FaultBrokerAppRestart })
	kinds = append(kinds, ClusterFaultKinds...)
	kinds = append(kinds, OwnBrokerFaultKinds...)
	kinds = append(kinds, ShortPauseAndPathKinds...)
	return Profile{
		Name: "cluster", Load: 5 * time.Minute, Warmup: 10 * time.Second, Cooldown: 10 * time.Second,
		Clients: 4, Rate: 4, CancelRatio: 0.4, AmendRatio: 0.4,
		Kinds: kinds, Faults: len(kinds) + 12,
		HoldMin: time.Second, HoldMax: 8 * time.Second,
		PauseMin: 9 * time.Second, PauseMax: 12 * time.Second,
		DrainBudget: 5 * time.Minute,
	}
}

// ProfileFromEnv picks the profile from CHAOS_PROFILE ("short", the default,
// "long" or "cluster") and applies the overrides CHAOS_DURATION (Load, a Go duration),
// CHAOS_FAULTS (a count) and CHAOS_BROKER_RESTART (true adds the broker app
// restart to the short profile).
func ProfileFromEnv(getenv func(string) string) (Profile, error) {
	var p Profile
	switch name := cmp.Or(getenv("CHAOS_PROFILE"), "short"); name {
	case "short":
		p = ShortProfile()
	case "long":
		p = LongProfile()
	case "cluster":
		p = ClusterProfile()
	default:
		return p, fmt.Errorf("CHAOS_PROFILE=%q: want short, long or cluster", name)
	}
	if s := getenv("CHAOS_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d < p.Warmup+p.Cooldown+10*time.Second {
			return p, fmt.Errorf("CHAOS_DURATION=%q: want a duration of at least %v", s, p.Warmup+p.Cooldown+10*time.Second)
		}
		p.Load = d
	}
	// The cluster profile runs on brokers of its own: the machine's broker
	// restart is nothing to it.
	if s := getenv("CHAOS_BROKER_RESTART"); s != "" && p.Name != "cluster" {
		on, err := strconv.ParseBool(s)
		if err != nil {
			return p, fmt.Errorf("CHAOS_BROKER_RESTART=%q: want true or false", s)
		}
		has := slices.Contains(p.Kinds, FaultBrokerAppRestart)
		switch {
		case on && !has:
			p.Kinds = append(p.Kinds, FaultBrokerAppRestart)
			p.Faults++
		case !on && has:
			p.Kinds = slices.DeleteFunc(p.Kinds, func(k FaultKind) bool { return k == FaultBrokerAppRestart })
		}
	}
	if s := getenv("CHAOS_FAULTS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < len(p.Kinds) {
			return p, fmt.Errorf("CHAOS_FAULTS=%q: want an integer of at least %d (one per kind)", s, len(p.Kinds))
		}
		p.Faults = n
	}
	return p, p.Validate()
}

// Without returns p without the given kinds (a fault this machine cannot
// inject), keeping its number of faults.
func (p Profile) Without(kinds ...FaultKind) Profile {
	p.Kinds = slices.DeleteFunc(slices.Clone(p.Kinds), func(k FaultKind) bool { return slices.Contains(kinds, k) })
	return p
}

// Validate reports a profile that cannot run.
func (p Profile) Validate() error {
	switch {
	case p.Load <= p.Warmup+p.Cooldown:
		return fmt.Errorf("profile %s: Load %v leaves no time for faults after Warmup %v and Cooldown %v", p.Name, p.Load, p.Warmup, p.Cooldown)
	case p.Clients < 1 || p.Rate <= 0:
		return fmt.Errorf("profile %s: want at least one client and a positive rate", p.Name)
	case p.CancelRatio < 0 || p.CancelRatio > 1:
		return fmt.Errorf("profile %s: CancelRatio %v not in [0, 1]", p.Name, p.CancelRatio)
	case p.Faults < len(p.Kinds):
		return fmt.Errorf("profile %s: %d faults cannot cover %d kinds", p.Name, p.Faults, len(p.Kinds))
	case p.HoldMin <= 0 || p.HoldMax < p.HoldMin:
		return fmt.Errorf("profile %s: want 0 < HoldMin <= HoldMax", p.Name)
	case p.Cooldown < p.HoldMax:
		return fmt.Errorf("profile %s: Cooldown %v shorter than HoldMax %v: the last fault would outlast the load", p.Name, p.Cooldown, p.HoldMax)
	case p.DrainBudget <= 0:
		return fmt.Errorf("profile %s: DrainBudget must be positive", p.Name)
	}
	if slices.ContainsFunc(p.Kinds, FaultKind.IsPause) {
		switch {
		case p.PauseMin <= 0 || p.PauseMax < p.PauseMin:
			return fmt.Errorf("profile %s: a pause kind wants 0 < PauseMin <= PauseMax", p.Name)
		case p.PauseMax >= p.Load-p.Warmup-p.Cooldown:
			return fmt.Errorf("profile %s: PauseMax %v does not fit in the fault window %v", p.Name, p.PauseMax, p.Load-p.Warmup-p.Cooldown)
		}
	}
	for _, k := range p.Kinds {
		if !slices.Contains(AllFaultKinds, k) && !slices.Contains(ClusterFaultKinds, k) &&
			!slices.Contains(InfraFaultKinds, k) && !slices.Contains(OwnBrokerFaultKinds, k) &&
			!slices.Contains(PauseAndPathFaultKinds, k) && !resourceFault(k) {
			return fmt.Errorf("profile %s: unknown fault kind %q", p.Name, k)
		}
	}
	return nil
}

// Topology names the processes faults can target.
type Topology struct {
	Relays    int // standalone relay processes, "relay-1" ...
	Consumers int // shipping processes, "shipping-1" ...
	Nodes     int // RabbitMQ nodes of the run's own cluster, "node-1" ...; 1 for a single node of its own, 0 for the machine's broker
}

// Process and proxy names used as fault targets.
const (
	TargetOrders       = "orders"
	TargetMongo        = "mongo"
	TargetAMQPOrders   = "amqp-orders"   // the proxy the orders API and relays use
	TargetAMQPShipping = "amqp-shipping" // the proxy the shipping consumers use
)

// RelayName and ShippingName name the i-th (from 1) process of a kind.
func RelayName(i int) string    { return "relay-" + strconv.Itoa(i) }
func ShippingName(i int) string { return "shipping-" + strconv.Itoa(i) }
func NodeName(i int) string     { return "node-" + strconv.Itoa(i) }

func (t Topology) targets(k FaultKind) []string {
	relays := []string{TargetOrders} // the API's in-process relay when none runs alone
	if t.Relays > 0 {
		relays = relays[:0]
		for i := 1; i <= t.Relays; i++ {
			relays = append(relays, RelayName(i))
		}
	}
	var shipping []string
	for i := 1; i <= t.Consumers; i++ {
		shipping = append(shipping, ShippingName(i))
	}
	if out, ok := t.pauseTargets(k, relays, shipping); ok {
		return out
	}
	switch k {
	case FaultKillOrders, FaultCrashOrdersAfterCommit:
		return []string{TargetOrders}
	case FaultKillRelay, FaultCrashRelayAfterPublish:
		return relays
	case FaultKillShipping, FaultCrashShippingAfterEffect, FaultCrashShippingAfterInbox:
		return shipping
	case FaultBrokerProxyDown, FaultBrokerProxyResetPeer, FaultBrokerProxyLatency, FaultBrokerProxyTimeout:
		return []string{TargetAMQPOrders, TargetAMQPShipping}
	case FaultMongoRestart, FaultMongoProxyDown, FaultMongoAckLoss, FaultMongoDiskFull:
		return []string{TargetMongo}
	case FaultNodeKill, FaultNodeAppRestart, FaultNodeProxyDown, FaultNodeMajorityDown, FaultNodeWipe, FaultNodePartition, FaultBrokerAlarm:
		var nodes []string
		for i := 1; i <= t.Nodes; i++ {
			nodes = append(nodes, NodeName(i))
		}
		return nodes
	}
	return []string{""}
}

// Step is one scheduled fault.
type Step struct {
	// At is the time from the start of the load.
	At     time.Duration
	Kind   FaultKind
	Target string
	// Hold is how long an outage lasts, a killed process stays down or a
	// paused one stays stopped.
	Hold time.Duration
	// CrashAfter is CRASH_AFTER for a crash point: the armed process dies the
	// CrashAfter-th time it reaches the point.
	CrashAfter int
}

func (s Step) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "t+%v %s", s.At.Round(time.Millisecond), s.Kind)
	if s.Target != "" {
		fmt.Fprintf(&b, " on %s", s.Target)
	}
	switch {
	case s.CrashAfter > 0:
		fmt.Fprintf(&b, " at hit %d", s.CrashAfter)
	case !s.Kind.Instant():
		fmt.Fprintf(&b, " for %v", s.Hold.Round(time.Millisecond))
	}
	return b.String()
}

// NewPlan schedules p.Faults faults under seed: every kind of p.Kinds once,
// the rest drawn at random from p.Kinds, at random times in the fault window,
// sorted by time. The same seed, profile and topology give the same plan.
func NewPlan(seed int64, p Profile, topo Topology) ([]Step, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	if topo.Consumers < 1 || topo.Relays < 0 {
		return nil, fmt.Errorf("plan: topology %+v: want at least one consumer", topo)
	}
	for _, k := range p.Kinds {
		if slices.Contains(ClusterFaultKinds, k) && topo.Nodes < 3 {
			return nil, fmt.Errorf("plan: %s needs a cluster of at least 3 nodes, topology has %d", k, topo.Nodes)
		}
		if slices.Contains(OwnBrokerFaultKinds, k) && topo.Nodes < 1 {
			return nil, fmt.Errorf("plan: %s needs a broker of the run's own (Topology.Nodes >= 1): never on the machine's broker", k)
		}
	}
	rng := rand.New(rand.NewPCG(uint64(seed), 0x636861_6f73)) // "chaos"
	kinds := slices.Clone(p.Kinds)
	extra := slices.DeleteFunc(slices.Clone(p.Kinds), func(k FaultKind) bool { return slices.Contains(p.Once, k) })
	for len(kinds) < p.Faults && len(extra) > 0 {
		kinds = append(kinds, extra[rng.IntN(len(extra))])
	}
	rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })

	window := p.Load - p.Warmup - p.Cooldown
	steps := make([]Step, len(kinds))
	for i, k := range kinds {
		targets := topo.targets(k)
		if k.IsPause() {
			// Drawn in an order of its own (the other kinds' draws are
			// unchanged): the hold first, so that the pause ends before the
			// cooldown.
			s := Step{Kind: k, Target: targets[rng.IntN(len(targets))],
				Hold: p.PauseMin + time.Duration(rng.Int64N(int64(p.PauseMax-p.PauseMin)+1))}
			s.At = p.Warmup + time.Duration(rng.Int64N(int64(window-s.Hold)))
			steps[i] = s
			continue
		}
		s := Step{
			At:     p.Warmup + time.Duration(rng.Int64N(int64(window))),
			Kind:   k,
			Target: targets[rng.IntN(len(targets))],
			Hold:   p.HoldMin + time.Duration(rng.Int64N(int64(p.HoldMax-p.HoldMin)+1)),
		}
		if _, ok := k.CrashPoint(); ok {
			s.CrashAfter = 1 + rng.IntN(5)
		}
		steps[i] = s
	}
	slices.SortStableFunc(steps, func(a, b Step) int { return cmp.Compare(a.At, b.At) })
	return steps, nil
}

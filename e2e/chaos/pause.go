package chaos

import "slices"

// The pause nemesis and the faults on the PostgreSQL path.
//
// A SIGKILLed process never comes back with stale beliefs: it starts again
// from what the stores say. A paused one does. SIGSTOP freezes a process
// without closing anything it holds (its sockets stay open, the kernel keeps
// acknowledging TCP for it), for longer than what the others wait before they
// take its work over; SIGCONT lets it go on from the instruction it stopped
// at, believing it still holds its lease, its slot or its deliveries.
const (
	// A relay paused past its lease (polling relay: RELAY_LEASE; the rows it
	// claimed are claimed again by another relay, which publishes them),
	// or, with the WAL relay, the relay holding the slot paused past
	// wal_sender_timeout and the takeover interval (the waiting relay takes
	// the slot and fences the paused one off). The target is the slot's
	// holder with the WAL relay, whatever the plan drew.
	FaultPauseRelay FaultKind = "pause_relay"
	// A shipping consumer paused with its prefetched deliveries unacked and
	// its inbox's cache of done messages going stale while the other
	// consumer applies events.
	FaultPauseShipping FaultKind = "pause_shipping"
	// The orders API paused with requests in flight: clients time out and
	// retry with the same Idempotency-Key while the paused process may
	// still commit and answer when it resumes.
	FaultPauseOrders FaultKind = "pause_orders"
	// The run's own PostgreSQL frozen: the postmaster and every child
	// (backends, WAL senders, checkpointer...), its process group. Stopping
	// the postmaster alone would only stop new connections: the backends of
	// open pools would go on serving.
	FaultPausePostgres FaultKind = "pause_postgres"

	// Toxiproxy between a client of the run's own PostgreSQL and the server
	// (the target is the proxy: the API's and the harness's, or one relay's).
	FaultPostgresProxyLatency   FaultKind = "postgres_proxy_latency"    // every packet delayed
	FaultPostgresProxyTimeout   FaultKind = "postgres_proxy_timeout"    // a blackhole: bytes swallowed, no reset
	FaultPostgresProxyResetPeer FaultKind = "postgres_proxy_reset_peer" // TCP RST on the next bytes
	// One relay cut from PostgreSQL (its own proxy disabled) while it still
	// reaches the broker.
	FaultPostgresRelayCut FaultKind = "postgres_relay_cut"
)

// PauseFaultKinds are the pause nemesis's kinds.
var PauseFaultKinds = []FaultKind{FaultPauseRelay, FaultPauseShipping, FaultPauseOrders, FaultPausePostgres}

// PostgresPathFaultKinds are the faults on the network path to the run's own
// PostgreSQL.
var PostgresPathFaultKinds = []FaultKind{FaultPostgresProxyLatency, FaultPostgresProxyTimeout,
	FaultPostgresProxyResetPeer, FaultPostgresRelayCut}

// PauseAndPathFaultKinds are both lists, in a stable order.
var PauseAndPathFaultKinds = slices.Concat(PauseFaultKinds, PostgresPathFaultKinds)

// OwnPostgresPauseAndPathKinds need a PostgreSQL server of the run's own:
// the PostgreSQL proxies front it only, and the harness signals only its own
// postmaster.
var OwnPostgresPauseAndPathKinds = slices.Concat([]FaultKind{FaultPausePostgres}, PostgresPathFaultKinds)

// ShortPauseAndPathKinds are those of them the short profile runs: the two
// pauses that test fencing where it matters most (a relay, a consumer) and
// the path faults, all of them over within the load.
var ShortPauseAndPathKinds = slices.Concat([]FaultKind{FaultPauseRelay, FaultPauseShipping}, PostgresPathFaultKinds)

// TargetPostgres is the proxy between the orders API (and the harness) and
// the run's own PostgreSQL. Each standalone relay has one of its own,
// PostgresProxyName(RelayName(i)).
const TargetPostgres = "postgres"

// PostgresProxyName names the PostgreSQL proxy of one process (a relay).
func PostgresProxyName(process string) string { return TargetPostgres + "@" + process }

// IsPause tells whether k is a pause: its Hold is drawn from the profile's
// PauseMin..PauseMax.
func (k FaultKind) IsPause() bool { return slices.Contains(PauseFaultKinds, k) }

// pauseTargets are the targets of the pause and PostgreSQL path kinds, and
// false for other kinds.
func (t Topology) pauseTargets(k FaultKind, relays, shipping []string) ([]string, bool) {
	switch k {
	case FaultPauseRelay:
		return relays, true
	case FaultPauseShipping:
		return shipping, true
	case FaultPauseOrders:
		return []string{TargetOrders}, true
	case FaultPausePostgres:
		return []string{TargetPostgres}, true
	case FaultPostgresProxyLatency, FaultPostgresProxyTimeout, FaultPostgresProxyResetPeer, FaultPostgresRelayCut:
		var out []string
		if k != FaultPostgresRelayCut || t.Relays == 0 {
			out = append(out, TargetPostgres) // without standalone relays the API's proxy carries its relay
		}
		for i := 1; i <= t.Relays; i++ {
			out = append(out, PostgresProxyName(RelayName(i)))
		}
		return out, true
	}
	return nil, false
}

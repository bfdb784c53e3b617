package chaos

import (
	"testing"
	"time"
)

// The node faults' assertions: the leader left the node killed as leader
// or cut away, no row was marked published while the majority was down, and
// the rows created during a node fault drained within the bound (a 220 s
// stall fails it).
func TestCheckClusterFaults(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC)
	run := func(faults []Fault, events ...CommittedEvent) Report {
		h, s, info := baseline()
		h.Faults = append(h.Faults, faults...)
		for i := range s.Events {
			s.Events[i].CreatedAt, s.Events[i].PublishedAt = t0.Add(-time.Hour), t0.Add(-time.Hour)
		}
		s.Events = append(s.Events, events...)
		return Check(h, s, info)
	}
	kill := func(leaderOnDown float64) Fault {
		return Fault{Kind: FaultNodeKillLeader, Target: "node-1", Start: t0, End: t0.Add(5 * time.Second),
			Measures: map[string]float64{MeasureLeaderOnDownNode: leaderOnDown}}
	}
	majority := Fault{Kind: FaultNodeMajorityDown, Target: "node-2", Start: t0, End: t0.Add(40 * time.Second),
		Measures: map[string]float64{MeasureQuorumLostFrom: 1, MeasureQuorumLostTo: 10}}
	row := func(created, published time.Duration) CommittedEvent {
		return CommittedEvent{MessageID: "x", OrderID: "o1", Version: 1, Type: EventCreated,
			CreatedAt: t0.Add(created), PublishedAt: t0.Add(published)}
	}

	if r := run([]Fault{kill(0), majority}, row(2*time.Second, 45*time.Second)); hasViolation(r, "cluster", "leader_not_moved") ||
		hasViolation(r, "cluster", "published_without_quorum") || hasViolation(r, "cluster", "node_fault_drain_too_slow") || len(r.NodeFaultDrains) != 2 {
		t.Errorf("a correct cluster run: %v, drains %+v; want no cluster violation and two drains", r.Violations, r.NodeFaultDrains)
	}
	for name, c := range map[string]struct {
		faults []Fault
		event  CommittedEvent
		kind   string
	}{
		"leader stayed":            {[]Fault{kill(1)}, row(time.Second, 6*time.Second), "leader_not_moved"},
		"leader unread":            {[]Fault{kill(-1)}, row(time.Second, 6*time.Second), "leader_unknown"},
		"published without quorum": {[]Fault{majority}, row(-time.Minute, 5*time.Second), "published_without_quorum"},
		"a 220 s stall":            {[]Fault{kill(0)}, row(time.Second, 225*time.Second), "node_fault_drain_too_slow"},
	} {
		if r := run(c.faults, c.event); !hasViolation(r, "cluster", c.kind) {
			t.Errorf("%s: %v; want a cluster %s", name, r.Violations, c.kind)
		}
	}
	// Marked within the grace after the kill: a confirm sent before it.
	if r := run([]Fault{majority}, row(-time.Minute, 2500*time.Millisecond)); hasViolation(r, "cluster", "published_without_quorum") {
		t.Errorf("a row marked 1.5s after the kill: %v; want no violation", r.Violations)
	}
}

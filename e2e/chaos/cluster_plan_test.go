package chaos

import (
	"slices"
	"testing"
)

func TestClusterProfile(t *testing.T) {
	p, err := ProfileFromEnv(func(k string) string {
		return map[string]string{"CHAOS_PROFILE": "cluster", "CHAOS_BROKER_RESTART": "true"}[k]
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range ClusterFaultKinds {
		if !slices.Contains(p.Kinds, k) {
			t.Errorf("cluster profile lacks %s", k)
		}
	}
	// It runs on brokers of its own: the machine broker's restart stays out,
	// whatever CHAOS_BROKER_RESTART says.
	if slices.Contains(p.Kinds, FaultBrokerAppRestart) {
		t.Error("cluster profile restarts the machine's broker")
	}
	if _, err := NewPlan(1, p, Topology{Relays: 2, Consumers: 2}); err == nil {
		t.Error("a plan with node faults was made for a topology without a cluster")
	}
	plan, err := NewPlan(1, p, Topology{Relays: 2, Consumers: 2, Nodes: 3})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[FaultKind]bool{}
	for _, s := range plan {
		seen[s.Kind] = true
		switch s.Kind {
		case FaultNodeKill, FaultNodeAppRestart, FaultNodeProxyDown:
			if !slices.Contains([]string{"node-1", "node-2", "node-3"}, s.Target) {
				t.Errorf("%v: target %q is no node", s, s.Target)
			}
			if s.Kind.Instant() {
				t.Errorf("%s counted instant: it is an outage held for a while", s.Kind)
			}
		case FaultNodeKillLeader:
			if s.Target != "" {
				t.Errorf("%v: the leader is found at injection, not planned", s)
			}
		}
	}
	for _, k := range p.Kinds {
		if !seen[k] {
			t.Errorf("plan misses %s", k)
		}
	}
	// The other profiles have no node fault.
	for _, other := range []Profile{ShortProfile(), LongProfile()} {
		for _, k := range ClusterFaultKinds {
			if slices.Contains(other.Kinds, k) {
				t.Errorf("profile %s has %s", other.Name, k)
			}
		}
	}
}

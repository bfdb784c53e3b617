package chaos

import (
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"
)

// The report names its run: the identity the suite passes in, and every
// fault with its actual times, in the order they started.
func TestReportCarriesTheRunsIdentity(t *testing.T) {
	h, s, run := baseline()
	t0 := h.Faults[0].Start
	h.Faults = append(h.Faults, Fault{Kind: FaultKillOrders, Target: TargetOrders, Start: t0.Add(-time.Second), End: t0.Add(-time.Second)})
	run.Identity = RunIdentity{
		RelayMode: "wal", Env: map[string]string{"CHAOS_SEED": "42"}, Commit: "abc123+dirty",
		KindsRequired: run.RequireKinds, Topology: Topology{Relays: 2, Consumers: 2},
		KindsSkipped: []SkippedKinds{{Kinds: []FaultKind{FaultNodePartition}, Reason: "no netns"}},
	}
	r := Check(h, s, run)
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	id := back.Identity
	if id.RelayMode != "wal" || id.Commit != "abc123+dirty" || id.Env["CHAOS_SEED"] != "42" || id.Topology.Relays != 2 ||
		len(id.KindsSkipped) != 1 || id.KindsSkipped[0].Reason != "no netns" || !slices.Equal(id.KindsRequired, run.RequireKinds) {
		t.Errorf("identity after a JSON round trip: %+v; want %+v", id, run.Identity)
	}
	if len(back.Faults) != 3 || back.Faults[0].Kind != FaultKillOrders || !back.Faults[2].End.Equal(h.Faults[1].End) {
		t.Errorf("faults %+v; want the three, by start, with their times", back.Faults)
	}
}

func TestEnvOverrides(t *testing.T) {
	got := EnvOverrides([]string{"CHAOS_PROFILE=long", "CHAOS_SEED=7", "CI=true", "HOME=/root",
		"TEST_DATABASE_URL=postgres://u:secret@h/db", "CHAOS_EMPTY=", "CHAOSX=1"})
	want := map[string]string{"CHAOS_PROFILE": "long", "CHAOS_SEED": "7", "CI": "true", "CHAOS_EMPTY": ""}
	if !maps.Equal(got, want) {
		t.Errorf("EnvOverrides = %v, want %v", got, want)
	}
}

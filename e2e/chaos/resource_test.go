package chaos

import (
	"slices"
	"testing"
	"time"
)

// The resource faults are the long profile's: every one of them is in it,
// scheduled at least once and held for a while, none in the short profile
// (make test's budget) nor in the cluster profile.
func TestResourceFaultsAreTheLongProfiles(t *testing.T) {
	long := LongProfile()
	for _, k := range ResourceFaultKinds {
		if !slices.Contains(long.Kinds, k) {
			t.Errorf("long profile lacks %s", k)
		}
		if slices.Contains(ShortProfile().Kinds, k) || slices.Contains(ClusterProfile().Kinds, k) {
			t.Errorf("%s in the short or the cluster profile", k)
		}
		if k.Instant() {
			t.Errorf("%s is instant: it is an outage held for a while", k)
		}
	}
	for _, k := range OwnPostgresResourceFaultKinds {
		if !slices.Contains(ResourceFaultKinds, k) {
			t.Errorf("%s needs the run's own PostgreSQL but is no resource fault", k)
		}
	}
	if err := long.Validate(); err != nil {
		t.Fatal(err)
	}
	for seed := range int64(10) {
		plan, err := NewPlan(seed, long, Topology{Relays: 2, Consumers: 2, Nodes: 1})
		if err != nil {
			t.Fatal(err)
		}
		seen := make(map[FaultKind]int)
		for _, s := range plan {
			seen[s.Kind]++
			switch s.Kind {
			case FaultMongoAckLoss, FaultMongoDiskFull:
				if s.Target != TargetMongo {
					t.Errorf("seed %d: %v, want MongoDB as the target", seed, s)
				}
			}
		}
		for _, k := range ResourceFaultKinds {
			if seen[k] == 0 {
				t.Errorf("seed %d: %s never scheduled", seed, k)
			}
		}
	}
	// Left out where the machine cannot inject them, the rest still runs.
	p := long.Without(OwnPostgresResourceFaultKinds...)
	if err := p.Validate(); err != nil || slices.ContainsFunc(p.Kinds, func(k FaultKind) bool { return slices.Contains(OwnPostgresResourceFaultKinds, k) }) {
		t.Errorf("long profile without the own-PostgreSQL resource faults: %v, kinds %v", err, p.Kinds)
	}
}

// The report lists each resource fault with the measures that show it took
// effect.
func TestFaultMeasuresListResourceFaults(t *testing.T) {
	t0 := time.Date(2026, 12, 4, 5, 0, 0, 0, time.UTC)
	h := History{Faults: []Fault{
		{Kind: FaultPostgresLongTransaction, Start: t0.Add(time.Second), End: t0.Add(3 * time.Second),
			Measures: map[string]float64{MeasureOthersPublished: 12, MeasureLockedPublished: 1}},
		{Kind: FaultKillShipping, Start: t0, End: t0},
		{Kind: FaultWALSlotInvalidated, Start: t0, End: t0.Add(time.Second), Measures: map[string]float64{MeasureSlotLost: 1}},
	}}
	got := faultMeasures(h)
	if len(got) != 2 || got[0].Kind != FaultWALSlotInvalidated || got[1].Kind != FaultPostgresLongTransaction {
		t.Fatalf("fault measures %+v, want the slot invalidation and the long transaction", got)
	}
	if got[1].Measures[MeasureOthersPublished] != 12 || got[1].Seconds != 2 {
		t.Errorf("long transaction measures %+v", got[1])
	}
}

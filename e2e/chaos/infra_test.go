package chaos

import (
	"testing"
	"time"
)

// A synchronous stall that saw an effect of an invisible order version
// fails the run, whatever the final state shows.
func TestCheckReportsPhantomsOfTheSynchronousStall(t *testing.T) {
	h, s, run := baseline()
	h.Faults = append(h.Faults, Fault{Kind: FaultPostgresSyncStall, Measures: map[string]float64{MeasurePhantomEffects: 2}})
	r := Check(h, s, run)
	found := false
	for _, v := range r.Violations {
		found = found || v.Invariant == "I2" && v.Kind == "phantom_effect"
	}
	if r.OK || !found || r.UnknownEffects != 2 {
		t.Errorf("ok=%v unknown_effects=%d violations=%v; want an I2 phantom_effect and 2 unknown effects", r.OK, r.UnknownEffects, r.Violations)
	}
	h.Faults[len(h.Faults)-1].Measures[MeasurePhantomEffects] = 0
	if r := Check(h, s, run); !r.OK {
		t.Errorf("a stall without phantoms: %v", r.Violations)
	}
}

// The report gives each infrastructure fault's measures, and for a
// migration the p99 of the operations that started while it ran beside
// that of operations that overlapped no fault.
func TestFaultMeasuresGiveTheAPIP99DuringAMigration(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 5, 0, 0, 0, time.UTC)
	var h History
	for i := range 200 {
		at := t0.Add(time.Duration(i) * 100 * time.Millisecond) // 0s .. 19.9s
		d := 10 * time.Millisecond
		if i == 150 || i == 151 {
			d = 2 * time.Second // during the migration
		}
		h.Ops = append(h.Ops, Op{Kind: OpCreate, Outcome: OutcomeOK, Start: at, End: at.Add(d)})
	}
	h.Faults = []Fault{
		{Kind: FaultMigrationUnderLoad, Start: t0.Add(15 * time.Second), End: t0.Add(16 * time.Second), Measures: map[string]float64{MeasureMigrateSeconds: 1}},
		{Kind: FaultKillRelay, Start: t0.Add(5 * time.Second), End: t0.Add(5 * time.Second)},
	}
	got := faultMeasures(h)
	if len(got) != 1 || got[0].Kind != FaultMigrationUnderLoad {
		t.Fatalf("fault measures %+v, want the migration only", got)
	}
	m := got[0]
	if m.APIOps != 11 || m.APIP99Ms != 2000 || m.APIP99CalmMs != 10 || m.Measures[MeasureMigrateSeconds] != 1 {
		t.Errorf("migration measures %+v; want 11 ops, p99 2000ms, calm p99 10ms", m)
	}
}

// The mass kill adds thousands of events: the short and long profiles
// schedule it exactly once, the other infrastructure faults as often as the
// draw gives.
func TestProfilesScheduleTheMassKillOnce(t *testing.T) {
	for _, p := range []Profile{ShortProfile(), LongProfile()} {
		for seed := range int64(10) {
			// The long profile runs on a broker node of its own (its
			// broker alarm needs one).
			plan, err := NewPlan(seed, p, Topology{Relays: 2, Consumers: 2, Nodes: 1})
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, s := range plan {
				if s.Kind == FaultRelayMassKill {
					n++
				}
			}
			if n != 1 || len(plan) != p.Faults {
				t.Errorf("%s seed %d: %d mass kills in %d steps, want 1 in %d", p.Name, seed, n, len(plan), p.Faults)
			}
		}
	}
}

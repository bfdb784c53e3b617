package chaos

import (
	"testing"
	"time"
)

// An acknowledged order the database lacks after an asynchronous failover
// that followed the acknowledgement is lost by the failover, reported apart
// and no violation; its effect, published from the old primary, is an
// orphan of that failover. The same loss with the failover before the
// acknowledgement, or without any failover, stays an I1 violation, and the
// effect an I2 one.
func TestCheckAccountsForTheDatabaseFailover(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 5, 0, 0, 0, time.UTC)
	lostOrder := func(failoverAt time.Duration, kind FaultKind) Report {
		h, s, run := baseline()
		for i := range h.Ops {
			h.Ops[i].Start, h.Ops[i].End = t0, t0.Add(time.Second)
		}
		h.Ops = append(h.Ops, Op{Kind: OpCreate, Key: "k9", OrderID: "o9", Outcome: OutcomeOK, Status: 201,
			Start: t0, End: t0.Add(time.Second)})
		h.Faults = append(h.Faults, Fault{Kind: kind, Start: t0.Add(failoverAt), End: t0.Add(failoverAt + time.Second)})
		s.Shipments = append(s.Shipments, Shipment{OrderID: "o9", Events: []AppliedEvent{{"9", EventCreated, 1}}})
		return Check(h, s, run)
	}

	r := lostOrder(2*time.Second, FaultPostgresFailover)
	if !r.OK || r.LostByDatabaseFailover != 1 || r.FailoverOrphanEffects != 1 || r.AcknowledgedNotCommitted != 0 || r.UnknownEffects != 0 {
		t.Errorf("failover after the ack: ok=%v lost_by_database_failover=%d failover_orphan_effects=%d acknowledged_not_committed=%d unknown_effects=%d %v; want 1, 1, 0, 0 and no violation",
			r.OK, r.LostByDatabaseFailover, r.FailoverOrphanEffects, r.AcknowledgedNotCommitted, r.UnknownEffects, r.Violations)
	}
	for name, r := range map[string]Report{
		"failover before the ack":     lostOrder(-10*time.Second, FaultPostgresFailover),
		"synchronous stall, no async": lostOrder(2*time.Second, FaultPostgresSyncStall),
	} {
		if r.OK || r.LostByDatabaseFailover != 0 || r.AcknowledgedNotCommitted != 1 {
			t.Errorf("%s: ok=%v lost_by_database_failover=%d acknowledged_not_committed=%d; want a violation", name, r.OK, r.LostByDatabaseFailover, r.AcknowledgedNotCommitted)
		}
	}
	// A cancel the database lost (the order stays at version 1) whose effect
	// went out: an orphan of the failover too. The same message id applied
	// to another event than the committed one (an id reused after the
	// failover) stays a violation.
	h, s, run := baseline()
	h.Faults = append(h.Faults, Fault{Kind: FaultPostgresFailover, Start: t0, End: t0})
	s.Shipments[0].Events = append(s.Shipments[0].Events, AppliedEvent{"8", EventCancelled, 2})
	if r := Check(h, s, run); r.FailoverOrphanEffects != 1 || r.UnknownEffects != 0 {
		t.Errorf("a lost cancel's effect: failover_orphan_effects=%d unknown_effects=%d %v, want 1, 0", r.FailoverOrphanEffects, r.UnknownEffects, r.Violations)
	}
	s.Shipments[0].Events[1] = AppliedEvent{"4", EventCancelled, 2} // message 4 is o2's cancel
	if r := Check(h, s, run); r.OK || r.UnknownEffects != 1 {
		t.Errorf("a message id applied to another order: ok=%v unknown_effects=%d, want a corrupted_effect violation", r.OK, r.UnknownEffects)
	}
	if r := lostOrder(2*time.Second, FaultPostgresSyncStall); r.UnknownEffects != 1 {
		t.Errorf("an effect of an order lost without an asynchronous failover: unknown_effects=%d, want 1", r.UnknownEffects)
	}
}

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

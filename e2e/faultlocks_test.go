package e2e

import (
	"slices"
	"testing"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// A broker alarm's check reads the outbox's attempts (the run's PostgreSQL)
// and shipping's applied events (MongoDB): no fault of either may run beside
// it, or the check fails on a cut connection, a harness error and not the
// system's (seen in a make chaos run: "count applied events: ... EOF" with a
// mongo_restart beside the alarm). And steps take their resources in one
// order, so that two steps never wait for each other.
func TestFaultStepsLockWhatTheirChecksRead(t *testing.T) {
	in := &injector{c: &cluster{}}
	alarm := in.resources(chaos.Step{Kind: chaos.FaultBrokerAlarm, Target: "node-1"})
	for _, want := range []string{"broker", chaos.TargetAMQPOrders, chaos.TargetAMQPShipping, "postgres", "mongo"} {
		if !slices.Contains(alarm, want) {
			t.Errorf("broker_alarm locks %v: not %q", alarm, want)
		}
	}
	// Every pair of resources that one step takes in an order, no step takes
	// in the other. (Locks a fault takes inside its own function, as
	// relay_mass_kill takes the database and the relays after its step's
	// resource, are outside this check.)
	before := map[[2]string]chaos.FaultKind{}
	for _, k := range chaos.AllFaultKinds {
		rs := in.resources(chaos.Step{Kind: k, Target: "x"})
		for i := range rs {
			for j := i + 1; j < len(rs); j++ {
				if other, ok := before[[2]string{rs[j], rs[i]}]; ok {
					t.Errorf("%s locks %s before %s, %s the other way round", k, rs[i], rs[j], other)
				}
				before[[2]string{rs[i], rs[j]}] = k
			}
		}
	}
}

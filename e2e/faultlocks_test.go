package e2e

import (
	"slices"
	"strings"
	"testing"
	"time"

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
	for _, k := range slices.Concat(chaos.AllFaultKinds, chaos.PauseAndPathFaultKinds) {
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

// A pause of a process takes the lock its kill and crash points take, so a
// pause never overlaps a kill of the same process; a relay's pause takes
// every relay (with the WAL relay it pauses the slot's holder, whichever the
// plan drew; with the polling relay it stops the others for a moment).
// A pause of the server and the faults on its proxies take the database's
// lock, as its restart and failover do (a failover points the proxies
// elsewhere).
func TestPauseLocksWhatAKillOfTheSameProcessLocks(t *testing.T) {
	in := &injector{c: &cluster{}}
	for _, tc := range []struct {
		pause, kill chaos.FaultKind
		target      string
	}{
		{chaos.FaultPauseShipping, chaos.FaultKillShipping, chaos.ShippingName(2)},
		{chaos.FaultPauseOrders, chaos.FaultKillOrders, chaos.TargetOrders},
		{chaos.FaultPausePostgres, chaos.FaultPostgresRestart, chaos.TargetPostgres},
		{chaos.FaultPostgresRelayCut, chaos.FaultPostgresRestart, chaos.PostgresProxyName(chaos.RelayName(1))},
		{chaos.FaultPostgresProxyTimeout, chaos.FaultPostgresRestart, chaos.PostgresProxyName(chaos.RelayName(2))},
		{chaos.FaultPostgresProxyLatency, chaos.FaultPostgresRestart, chaos.TargetPostgres},
		{chaos.FaultPostgresProxyResetPeer, chaos.FaultPostgresRestart, chaos.TargetPostgres},
	} {
		got := in.resources(chaos.Step{Kind: tc.pause, Target: tc.target})
		want := in.resources(chaos.Step{Kind: tc.kill, Target: tc.target})
		if !slices.Equal(got, want) {
			t.Errorf("%s on %s locks %v, %s locks %v", tc.pause, tc.target, got, tc.kill, want)
		}
	}
	in.c.relays = []*proc{{spec: procSpec{name: chaos.RelayName(1)}}, {spec: procSpec{name: chaos.RelayName(2)}}}
	all := []string{chaos.RelayName(1), chaos.RelayName(2)}
	for _, mode := range []string{"", "wal"} {
		t.Setenv("CHAOS_RELAY_MODE", mode)
		if got := in.resources(chaos.Step{Kind: chaos.FaultPauseRelay, Target: chaos.RelayName(2)}); !slices.Equal(got, all) {
			t.Errorf("CHAOS_RELAY_MODE=%q: a relay's pause locks %v, want every relay %v", mode, got, all)
		}
	}
	if got := in.resources(chaos.Step{Kind: chaos.FaultKillRelay, Target: chaos.RelayName(1)}); !slices.Contains(all, got[0]) || len(got) != 1 {
		t.Errorf("a WAL relay's kill locks %v", got)
	}
}

// An armed crash point's clock runs from when the workload has carried
// enough events past it, not from the arming: in a make chaos WAL run a
// relay crash point armed while the API was paused and the database full
// failed the run after a fixed 45 s, though no event had come for the relay
// to publish.
func TestCrashPointClockWaitsForTheWorkload(t *testing.T) {
	armed := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return armed.Add(d) }
	newClock := func() *reachClock {
		return &reachClock{armed: armed, need: 3, window: 45 * time.Second, limit: 3 * time.Minute}
	}

	// The workload held for two minutes: not expired, then 45 s after the
	// third acknowledgement it is.
	c := newClock()
	for d := time.Second; d <= 2*time.Minute; d += time.Second {
		if c.expired(at(d), 2) {
			t.Fatalf("expired at %v with 2 of 3 operations acknowledged", d)
		}
	}
	if c.expired(at(2*time.Minute+time.Second), 3) {
		t.Fatal("expired as the third operation was acknowledged")
	}
	if c.expired(at(2*time.Minute+45*time.Second), 5) {
		t.Fatal("expired 44 s after the workload flowed")
	}
	if !c.expired(at(2*time.Minute+46*time.Second), 5) {
		t.Fatal("not expired 45 s after the workload flowed")
	}

	// A flowing workload: 45 s after the arming.
	c = newClock()
	if c.expired(at(time.Second), 10) || c.expired(at(44*time.Second), 10) {
		t.Fatal("expired within 45 s of a flowing workload")
	}
	if !c.expired(at(46*time.Second), 10) {
		t.Fatal("not expired 45 s into a flowing workload")
	}
	if got := c.describe(at(46*time.Second), 10); !strings.Contains(got, "acknowledged 3 operations") {
		t.Errorf("describe: %q", got)
	}

	// A workload that never flows: the limit.
	c = newClock()
	if c.expired(at(3*time.Minute-time.Second), 0) {
		t.Fatal("expired before the limit")
	}
	if !c.expired(at(3*time.Minute), 0) {
		t.Fatal("not expired at the limit")
	}
	if got := c.describe(at(3*time.Minute), 0); !strings.Contains(got, "acknowledged 0 operations") {
		t.Errorf("describe: %q", got)
	}
}

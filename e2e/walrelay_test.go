package e2e

import (
	"os"
	"strings"
	"testing"
)

// relayModeEnv is the relays' RELAY_MODE as CHAOS_RELAY_MODE asks: empty
// for the polling relay (the default), or, for "wal", the WAL relay
// (pkg/outbox/outboxwal) on a slot of the run's own. Its slot lives in the
// run's database; DROP DATABASE drops it with the database once the relays
// stopped.
func relayModeEnv(runID string) []string {
	if os.Getenv("CHAOS_RELAY_MODE") != "wal" {
		return nil
	}
	slot := "wal_" + strings.ToLower(strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			return r
		}
		return '_'
	}, runID))
	if len(slot) > 63 {
		slot = slot[:63]
	}
	return []string{"RELAY_MODE=wal", "RELAY_WAL_SLOT=" + slot}
}

// TestChaosWAL is the chaos suite's short profile, shortened further (30s of
// load), with the WAL relay: relay kills (the waiting relay takes the slot
// over), broker cuts, PostgreSQL restarts (of the run's own cluster), and
// the same invariants. `make chaos` runs the long profile with it too.
func TestChaosWAL(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos suite takes minutes; not run with -short")
	}
	t.Setenv("CHAOS_RELAY_MODE", "wal")
	if os.Getenv("CHAOS_WAL_DURATION") != "" {
		t.Setenv("CHAOS_DURATION", os.Getenv("CHAOS_WAL_DURATION"))
	} else {
		t.Setenv("CHAOS_PROFILE", "short")
		t.Setenv("CHAOS_DURATION", "30s")
	}
	if os.Getenv("CHAOS_REPORT") == "" {
		t.Setenv("CHAOS_REPORT", "chaos-report-wal.json")
	}
	TestChaos(t)
}

// walHoldOtherRelays, with the WAL relay, stops every relay but target for
// the length of a crash-point step and returns what starts them again: only
// the relay streaming from the slot publishes, so a crash point armed on a
// relay that waits for the slot would never be reached. With the polling
// relay it does nothing.
func (in *injector) walHoldOtherRelays(target string) func() {
	if os.Getenv("CHAOS_RELAY_MODE") != "wal" {
		return func() {}
	}
	var stopped []*proc
	isRelay := false
	for _, p := range in.c.relays {
		if p.spec.name == target {
			isRelay = true
		}
	}
	if !isRelay {
		return func() {}
	}
	for _, p := range in.c.relays {
		if p.spec.name != target {
			p.stop()
			stopped = append(stopped, p)
		}
	}
	return func() {
		for _, p := range stopped {
			if err := p.ensureRunning(); err != nil {
				in.logf("restart %s after the crash point: %v", p.spec.name, err)
			}
		}
	}
}

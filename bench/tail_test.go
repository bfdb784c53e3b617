package main

import (
	"os"
	"strings"
	"testing"
	"time"
)

func TestParseProcStatCPU(t *testing.T) {
	text := "cpu  100 5 20 800 40 3 2 30 0 0\ncpu0 50 2 10 400 20 1 1 15 0 0\nintr 1 2 3\n"
	got, err := parseProcStatCPU(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	if want := (cpuTimes{busy: 100 + 5 + 20 + 3 + 2, idle: 800, iowait: 40, steal: 30}); got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	for _, bad := range []string{"intr 1 2\n", "cpu 1 2 3\n", "cpu 1 2 3 4 5 6 7 x\n"} {
		if _, err := parseProcStatCPU(strings.NewReader(bad)); err == nil {
			t.Errorf("parseProcStatCPU(%q) accepted it", bad)
		}
	}
	f, err := os.Open("/proc/stat")
	if err != nil {
		t.Skipf("no /proc/stat here: %v", err)
	}
	defer f.Close()
	if real, err := parseProcStatCPU(f); err != nil || real.busy+real.idle == 0 {
		t.Fatalf("this machine's /proc/stat: %+v, %v", real, err)
	}
}

// samplesOf returns one machine sample per 100 ms from t0, each interval with
// the busy, iowait and steal ticks given (out of 20: two cores of 10 ticks).
func samplesOf(t0 time.Time, per [][3]uint64) []machineSample {
	var cur cpuTimes
	out := []machineSample{{at: t0, t: cur}}
	for i, p := range per {
		cur.busy += p[0]
		cur.iowait += p[1]
		cur.steal += p[2]
		cur.idle += 20 - p[0] - p[1] - p[2]
		out = append(out, machineSample{at: t0.Add(time.Duration(i+1) * 100 * time.Millisecond), t: cur})
	}
	return out
}

func TestLoadBetween(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s := samplesOf(t0, [][3]uint64{{10, 0, 0}, {20, 0, 0}, {4, 2, 10}, {0, 0, 0}})
	// 150 to 250 ms widens to the samples at 100 and 300 ms: the second and
	// third intervals.
	got, ok := loadBetween(s, t0.Add(150*time.Millisecond), t0.Add(250*time.Millisecond))
	if !ok {
		t.Fatal("not covered")
	}
	if want := (machineLoad{Busy: 0.6, IOWait: 0.05, Steal: 0.25}); got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	if _, ok := loadBetween(s, t0.Add(-time.Second), t0.Add(time.Millisecond)); ok {
		t.Error("an interval starting before the first sample is covered")
	}
	if _, ok := loadBetween(s, t0, t0.Add(time.Second)); ok {
		t.Error("an interval ending after the last sample is covered")
	}
}

func TestTailOf(t *testing.T) {
	t0 := time.Unix(2000, 0)
	// 200 orders over 2 s at 10 ms; three of them (the p99's rank is 198),
	// committed in the same second, took 300 ms (250 of them before their delivery) while the
	// machine was busy; the rest took 5 ms.
	per := make([][3]uint64, 30)
	for i := range per {
		per[i] = [3]uint64{4, 0, 0}
	}
	for i := 11; i <= 14; i++ { // 1.1 to 1.5 s: busy, and half of it stolen
		per[i] = [3]uint64{10, 0, 10}
	}
	samples := samplesOf(t0, per)
	var trips []orderTrip
	for i := range 200 {
		c := t0.Add(time.Duration(i) * 10 * time.Millisecond)
		lat, relay := 5*time.Millisecond, 2*time.Millisecond
		if i == 110 || i == 115 || i == 120 {
			lat, relay = 300*time.Millisecond, 250*time.Millisecond
		}
		trips = append(trips, orderTrip{committed: c, delivered: c.Add(relay), latency: lat})
	}
	r := tailOf(trips, samples)
	if r.Orders != 3 || r.FromMs != 300 || r.Moments != 1 {
		t.Fatalf("tail %+v: want the 3 orders of 300 ms, committed in 1 second", r)
	}
	if r.RelayShareMs != 250 || r.ShippingShareMs != 50 {
		t.Errorf("shares %v and %v ms, want 250 and 50", r.RelayShareMs, r.ShippingShareMs)
	}
	if r.During == nil || r.During.Steal < 0.3 || r.Window == nil || r.Window.Steal > r.During.Steal/2 {
		t.Errorf("during the tail %+v, over the window %+v: want the stolen time to show during the tail", r.During, r.Window)
	}
	if one := tailOf(trips[:1], samples); one.Orders != 1 {
		t.Errorf("the tail of one order has %d", one.Orders)
	}
	if tailOf(nil, samples).Orders != 0 {
		t.Error("a tail of no orders")
	}
}

func TestStatementsPerOrder(t *testing.T) {
	got := statementsPerOrder(map[string][]time.Duration{
		"claim":       {time.Millisecond, 3 * time.Millisecond},
		"claim_empty": {500 * time.Microsecond, 500 * time.Microsecond, 500 * time.Microsecond, 500 * time.Microsecond},
	}, 4)
	want := map[string]float64{"claim_per_order": 0.5, "claim_mean_ms": 2, "claim_empty_per_order": 1, "claim_empty_mean_ms": 0.5}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if statementsPerOrder(nil, 4) != nil || statementsPerOrder(map[string][]time.Duration{"claim": {1}}, 0) != nil {
		t.Error("nothing recorded, or no order: want nil")
	}
}

package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestSweepRates(t *testing.T) {
	if got, want := sweepRates(100, 6), []int{100, 150, 225, 338, 506, 759}; !slices.Equal(got, want) {
		t.Fatalf("sweepRates(100, 6) = %v, want %v", got, want)
	}
	if got := sweepRates(100, 0); len(got) != 0 {
		t.Fatalf("sweepRates(100, 0) = %v, want none", got)
	}
}

func TestSweepStageJudgeAndMaxSustained(t *testing.T) {
	stage := func(rate int, p99 time.Duration, late int, saturated bool) sweepStage {
		s := sweepStage{Rate: rate, Issued: rate, p99: p99, Late: late, Saturated: saturated}
		s.judge(sweepP99)
		return s
	}
	if s := stage(100, sweepP99, 0, false); !s.Passed {
		t.Error("a stage at exactly the p99 limit failed")
	}
	for name, s := range map[string]sweepStage{
		"p99 over":        stage(100, sweepP99+time.Microsecond, 0, false),
		"late order":      stage(100, time.Millisecond, 1, false),
		"saturated":       stage(100, time.Millisecond, 0, true),
		"nothing issued":  func() sweepStage { s := sweepStage{Rate: 100}; s.judge(sweepP99); return s }(),
		"p99 far over 25": stage(100, time.Second, 0, false),
	} {
		if s.Passed {
			t.Errorf("%s: passed", name)
		}
	}

	ok, bad := stage(100, time.Millisecond, 0, false), stage(150, time.Second, 0, false)
	ok2 := stage(150, time.Millisecond, 0, false)
	for _, tt := range []struct {
		stages []sweepStage
		rate   int
		capped bool
	}{
		{nil, 0, false},
		{[]sweepStage{bad}, 0, false},
		{[]sweepStage{ok, bad}, 100, false},
		{[]sweepStage{ok, ok2}, 150, true},
		// A stage after the first failure does not count.
		{[]sweepStage{ok, bad, stage(225, time.Millisecond, 0, false)}, 100, false},
	} {
		if rate, capped := maxSustained(tt.stages); rate != tt.rate || capped != tt.capped {
			t.Errorf("maxSustained(%d stages) = %d, %v; want %d, %v", len(tt.stages), rate, capped, tt.rate, tt.capped)
		}
	}
}

func TestOpenLoop(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex
	var dues []time.Time
	start := time.Now()
	n, saturated, err := openLoop(ctx, 200, 500*time.Millisecond, 1000, func(_ context.Context, _ int, due time.Time) error {
		mu.Lock()
		dues = append(dues, due)
		mu.Unlock()
		return nil
	})
	if err != nil || saturated || n != 100 || len(dues) != 100 {
		t.Fatalf("openLoop(200/s, 0.5s) = %d issued, saturated %v, %v; %d calls; want 100, false, nil", n, saturated, err, len(dues))
	}
	slices.SortFunc(dues, func(a, b time.Time) int { return a.Compare(b) })
	for i := 1; i < len(dues); i++ {
		if d := dues[i].Sub(dues[i-1]); d != 5*time.Millisecond {
			t.Fatalf("due times %d and %d are %v apart, want 5ms", i-1, i, d)
		}
	}
	if dues[0].Before(start) || dues[0].Sub(start) > time.Second {
		t.Fatalf("first due time %v after the start, want about 0", dues[0].Sub(start))
	}

	// Calls that never return before the loop is saturated: it is an open
	// loop, so it issues maxInFlight of them, then stops and says so.
	release := make(chan struct{})
	time.AfterFunc(2*time.Second, func() { close(release) })
	n, saturated, err = openLoop(ctx, 1000, 10*time.Second, 10, func(context.Context, int, time.Time) error {
		<-release
		return nil
	})
	if err != nil || !saturated || n != 10 {
		t.Fatalf("blocked calls: %d issued, saturated %v, %v; want 10, true, nil", n, saturated, err)
	}
	if _, _, err := openLoop(ctx, 0, time.Second, 1, nil); err == nil {
		t.Fatal("openLoop at rate 0 returned no error")
	}
}

func TestSummarizeStage(t *testing.T) {
	t0 := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	due := map[string]time.Time{}
	arrived := map[string]time.Time{}
	for i := range 99 {
		id := fmt.Sprintf("o%d", i)
		due[id] = t0
		arrived[id] = t0.Add(time.Duration(i+1) * time.Millisecond) // 1..99 ms
	}
	due["late"] = t0
	var s sweepStage
	if err := summarizeStage(&s, due, arrived, t0.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	// 100 latencies: 1..99 ms and the late order at the deadline, 1 s.
	if s.Late != 1 || s.P50ms != 50 || s.P99ms != 99 || s.MaxMs != 1000 || s.p99 != 99*time.Millisecond {
		t.Fatalf("summarizeStage = %+v, want 1 late, p50 50, p99 99, max 1000 ms", s)
	}
	if err := summarizeStage(&sweepStage{}, nil, nil, t0); err == nil {
		t.Fatal("a stage without orders returned no error")
	}
}

// paced, unlike openLoop, waits for a slot when maxInFlight calls are out:
// every due call is made, never more than maxInFlight at once.
func TestPacedWaitsForASlot(t *testing.T) {
	var out, most atomic.Int64
	n, err := paced(context.Background(), 200, 100*time.Millisecond, 1, func(context.Context, int) error {
		if c := out.Add(1); c > most.Load() {
			most.Store(c)
		}
		time.Sleep(20 * time.Millisecond)
		out.Add(-1)
		return nil
	})
	if err != nil || n != 20 || most.Load() != 1 {
		t.Errorf("paced: %d calls, at most %d at once, err %v; want 20, 1, nil", n, most.Load(), err)
	}
}

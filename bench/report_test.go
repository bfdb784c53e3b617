package main

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestPercentileNearestRank(t *testing.T) {
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = time.Duration(i+1) * time.Millisecond // 1ms..100ms
	}
	tests := []struct {
		name   string
		sorted []time.Duration
		p      float64
		want   time.Duration
	}{
		{"single sample is every percentile", []time.Duration{7}, 99, 7},
		{"p50 of 1..100", hundred, 50, 50 * time.Millisecond},
		{"p99 of 1..100", hundred, 99, 99 * time.Millisecond},
		{"p100 is the max", hundred, 100, 100 * time.Millisecond},
		{"p1 is the min", hundred, 1, time.Millisecond},
		{"p50 of two takes the lower", []time.Duration{1, 9}, 50, 1},
		{"p51 of two takes the upper", []time.Duration{1, 9}, 51, 9},
		{"p99 of ten is the max", []time.Duration{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 99, 10},
		{"p90 of ten", []time.Duration{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 90, 9},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := percentile(tt.sorted, tt.p); got != tt.want {
				t.Errorf("percentile(p%v) = %v, want %v", tt.p, got, tt.want)
			}
		})
	}
}

func TestSummarizeSortsAndRejectsEmpty(t *testing.T) {
	if _, err := summarize(nil); err == nil {
		t.Fatal("summarize(nil) returned no error; a figure without samples must fail")
	}
	ds := make([]time.Duration, 1000)
	for i := range ds {
		ds[i] = time.Duration(i+1) * time.Microsecond
	}
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(ds), func(i, j int) { ds[i], ds[j] = ds[j], ds[i] })
	s, err := summarize(ds)
	if err != nil {
		t.Fatal(err)
	}
	want := Latencies{N: 1000, P50: 500 * time.Microsecond, P90: 900 * time.Microsecond, P99: 990 * time.Microsecond, Max: 1000 * time.Microsecond}
	if s != want {
		t.Fatalf("summarize = %+v, want %+v", s, want)
	}
}

func TestMedianAndRate(t *testing.T) {
	xs := []float64{5, 1, 3}
	if got := median(xs); got != 3 {
		t.Errorf("median odd = %v, want 3", got)
	}
	if !slices.Equal(xs, []float64{5, 1, 3}) {
		t.Errorf("median changed its input: %v", xs)
	}
	if got := median([]float64{4, 1, 3, 2}); got != 2.5 {
		t.Errorf("median even = %v, want 2.5", got)
	}
	if got := median(nil); got != 0 {
		t.Errorf("median empty = %v, want 0", got)
	}
	if got := rate(100_000, 4*time.Second); got != 25_000 {
		t.Errorf("rate = %v, want 25000", got)
	}
	if got := rate(10, 0); got != 0 {
		t.Errorf("rate over zero time = %v, want 0", got)
	}
	if got := ms(1500 * time.Microsecond); got != 1.5 {
		t.Errorf("ms = %v, want 1.5", got)
	}
}

func TestNewFigureRatioAndVerdict(t *testing.T) {
	tests := []struct {
		name            string
		value, baseline float64
		goal            Goal
		wantRatio       *float64
		wantMet         *bool
	}{
		{"rate above its floor", 9000, 10000, Goal{RatioAtLeast, 0.8}, ptr(0.9), ptr(true)},
		{"rate below its floor", 7000, 10000, Goal{RatioAtLeast, 0.8}, ptr(0.7), ptr(false)},
		{"rate exactly at its floor", 8000, 10000, Goal{RatioAtLeast, 0.8}, ptr(0.8), ptr(true)},
		{"latency under its ceiling", 1.1, 1.0, Goal{RatioAtMost, 1.15}, ptr(1.1), ptr(true)},
		{"latency over its ceiling", 1.5, 1.0, Goal{RatioAtMost, 1.15}, ptr(1.5), ptr(false)},
		{"absolute ceiling met", 12, 900, Goal{ValueAtMost, 25}, ptr(0.0133), ptr(true)},
		{"absolute ceiling missed", 30, 900, Goal{ValueAtMost, 25}, ptr(0.0333), ptr(false)},
		{"absolute floor met", 120000, 10000, Goal{ValueAtLeast, 100000}, ptr(12.0), ptr(true)},
		{"absolute floor missed", 90000, 10000, Goal{ValueAtLeast, 100000}, ptr(9.0), ptr(false)},
		{"no goal, no verdict", 5, 10, Goal{}, ptr(0.5), nil},
		{"zero baseline: no ratio, ratio goal missed", 5, 0, Goal{RatioAtLeast, 0.5}, nil, ptr(false)},
		{"zero baseline does not hide an absolute goal", 5, 0, Goal{ValueAtMost, 25}, nil, ptr(true)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFigure("f", "u", tt.value, tt.baseline, tt.goal, "", "", nil)
			if !equalPtr(f.Ratio, tt.wantRatio) {
				t.Errorf("ratio = %v, want %v", deref(f.Ratio), deref(tt.wantRatio))
			}
			if (f.Met == nil) != (tt.wantMet == nil) || f.Met != nil && *f.Met != *tt.wantMet {
				t.Errorf("met = %v, want %v", deref(f.Met), deref(tt.wantMet))
			}
		})
	}
}

func TestGoalText(t *testing.T) {
	for _, tt := range []struct {
		g    Goal
		want string
	}{
		{Goal{RatioAtLeast, 0.8}, ">= 0.80x"},
		{Goal{RatioAtMost, 1.15}, "<= 1.15x"},
		{Goal{ValueAtMost, 25}, "<= 25.00 ms"},
		{Goal{ValueAtLeast, 25}, ">= 25.00 ms"},
		{Goal{}, "-"},
	} {
		if got := tt.g.String("ms"); got != tt.want {
			t.Errorf("%+v.String() = %q, want %q", tt.g, got, tt.want)
		}
	}
}

// TestReportJSONShape pins the file other tools read: field names, a null
// ratio and verdict where there is none, and the machine block.
func TestReportJSONShape(t *testing.T) {
	r := Report{
		StartedAt:       time.Date(2026, 11, 29, 22, 0, 0, 0, time.UTC),
		DurationSeconds: 480.5,
		Machine:         Machine{NumCPU: 2, MemoryMiB: 24000, Go: "go1.26.8", PostgreSQL: "15.20", RabbitMQ: "3.10.8"},
		Figures: []Figure{
			withLoad(newFigure("relay_drain_1_relay", "events/s", 9000, 10000, Goal{RatioAtLeast, 0.8}, "m", "b", map[string]any{"backlog": 100000}), 0.52, 3.4),
			newFigure("e2e_latency_wake_p50", "ms", 4, 0, Goal{}, "m", "b", nil),
		},
		Errors: []string{"inbox_throughput: boom"},
	}
	path := filepath.Join(t.TempDir(), "out.json")
	if err := writeJSON(path, r); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		StartedAt       string           `json:"started_at"`
		DurationSeconds float64          `json:"duration_seconds"`
		Machine         map[string]any   `json:"machine"`
		Figures         []map[string]any `json:"figures"`
		Errors          []string         `json:"errors"`
	}
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatalf("report is not JSON: %v\n%s", err, raw)
	}
	if got.StartedAt != "2026-11-29T22:00:00Z" || got.DurationSeconds != 480.5 || len(got.Errors) != 1 {
		t.Errorf("header = %q %v %v", got.StartedAt, got.DurationSeconds, got.Errors)
	}
	for _, k := range []string{"nproc", "memory_mib", "go", "postgresql", "rabbitmq"} {
		if _, ok := got.Machine[k]; !ok {
			t.Errorf("machine has no %q: %v", k, got.Machine)
		}
	}
	if len(got.Figures) != 2 {
		t.Fatalf("%d figures, want 2", len(got.Figures))
	}
	drain := got.Figures[0]
	for k, want := range map[string]any{
		"name": "relay_drain_1_relay", "unit": "events/s", "value": 9000.0, "baseline": 10000.0,
		"ratio": 0.9, "met": true, "goal_text": ">= 0.80x", "measures": "m", "baseline_is": "b",
	} {
		if drain[k] != want {
			t.Errorf("figure[0][%q] = %#v, want %#v", k, drain[k], want)
		}
	}
	if g, _ := drain["goal"].(map[string]any); g["kind"] != "ratio_at_least" || g["limit"] != 0.8 {
		t.Errorf("figure[0].goal = %#v", drain["goal"])
	}
	if d, _ := drain["details"].(map[string]any); d["backlog"] != 100000.0 {
		t.Errorf("figure[0].details = %#v", drain["details"])
	}
	e2e := got.Figures[1]
	for _, k := range []string{"ratio", "met"} {
		v, ok := e2e[k]
		if !ok || v != nil {
			t.Errorf("figure[1][%q] = %#v (present %v), want null", k, v, ok)
		}
	}
	if _, ok := e2e["details"]; ok {
		t.Errorf("figure[1] has details %#v, want none", e2e["details"])
	}
	if drain["load1_start"] != 0.52 || drain["load1_end"] != 3.4 {
		t.Errorf("figure[0] load1 = %#v to %#v, want 0.52 to 3.4", drain["load1_start"], drain["load1_end"])
	}
	if _, ok := e2e["load1_start"]; ok {
		t.Errorf("figure[1] has load1_start %#v, want none (not read)", e2e["load1_start"])
	}
}

func TestParseLoad1(t *testing.T) {
	if v, err := parseLoad1("14.58 7.29 3.13 19/272 6664\n"); err != nil || v != 14.58 {
		t.Fatalf("parseLoad1 = %v, %v; want 14.58", v, err)
	}
	for _, bad := range []string{"", "0.5 0.4", "x 0.4 0.3 1/2 3", "-1 0.4 0.3 1/2 3"} {
		if _, err := parseLoad1(bad); err == nil {
			t.Errorf("parseLoad1(%q) accepted it", bad)
		}
	}
}

func TestWriteTable(t *testing.T) {
	var buf bytes.Buffer
	err := writeTable(&buf, Report{
		Figures: []Figure{
			withLoad(newFigure("relay_drain_1_relay", "events/s", 9000, 10000, Goal{RatioAtLeast, 0.8}, "", "", nil), 1.1, 3.456),
			newFigure("write_overhead_p50", "ms", 0.8, 0.5, Goal{RatioAtMost, 1.15}, "", "", nil),
			newFigure("e2e_latency_wake_p50", "ms", 4.25, 500, Goal{}, "", "", nil),
		},
		Errors: []string{"claim_flat: no claim observed"},
	})
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 5 {
		t.Fatalf("table has %d lines, want header, 3 figures and 1 error:\n%s", len(lines), buf.String())
	}
	for i, want := range [][]string{
		{"figure", "unit", "value", "baseline", "ratio", "goal", "verdict", "load1"},
		{"relay_drain_1_relay", "events/s", "9000", "10000", "0.90x", ">=", "0.80x", "met", "1.10-3.46"},
		{"write_overhead_p50", "ms", "0.8", "0.5", "1.60x", "<=", "1.15x", "MISSED", "-"},
		{"e2e_latency_wake_p50", "ms", "4.25", "500.0", "0.01x", "-", "-", "-"},
		{"error:", "claim_flat:", "no", "claim", "observed"},
	} {
		if got := strings.Fields(lines[i]); !slices.Equal(got, want) {
			t.Errorf("line %d = %q, want %q", i, got, want)
		}
	}
}

func TestFormatNumber(t *testing.T) {
	for x, want := range map[float64]string{33012.4: "33012", 412.34: "412.3", 4.216: "4.22", 0.387: "0.387", 0.5: "0.5", 0: "0"} {
		if got := formatNumber(x); got != want {
			t.Errorf("formatNumber(%v) = %q, want %q", x, got, want)
		}
	}
}

func TestSelectFigures(t *testing.T) {
	all, err := selectFigures("")
	if err != nil || !slices.Equal(all, figureOrder) {
		t.Fatalf("selectFigures(\"\") = %v, %v; want every figure", all, err)
	}
	got, err := selectFigures("e2e_latency, relay_drain")
	if err != nil || !slices.Equal(got, []string{"relay_drain", "e2e_latency"}) {
		t.Fatalf("selectFigures = %v, %v; want run order kept", got, err)
	}
	if _, err := selectFigures("relay_drain,nope"); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Fatalf("unknown figure: err = %v", err)
	}
}

func TestInboxWorkloadDuplicates(t *testing.T) {
	msgs := inboxWorkload(1000, 0.2, rand.New(rand.NewPCG(7, 8)))
	if len(msgs) != 1000 {
		t.Fatalf("%d messages, want 1000", len(msgs))
	}
	firstSeen := map[string]int{}
	dups := 0
	for i, m := range msgs {
		if m.doc.MessageID != m.id || m.doc.ID != m.doc.OrderID+"/1" {
			t.Fatalf("message %d: id %q, document %+v", i, m.id, m.doc)
		}
		if _, ok := firstSeen[m.id]; ok {
			dups++
			continue
		}
		firstSeen[m.id] = i
	}
	if dups != 200 || len(firstSeen) != 800 {
		t.Fatalf("%d duplicates of %d distinct messages, want 200 of 800", dups, len(firstSeen))
	}
}

func ptr[T any](v T) *T { return &v }

func withLoad(f Figure, start, end float64) Figure {
	f.Load1Start, f.Load1End = &start, &end
	return f
}

func equalPtr(a, b *float64) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func deref[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"
)

// GoalKind says how a figure is judged.
type GoalKind string

const (
	// GoalNone: reported for context, not judged.
	GoalNone GoalKind = ""
	// RatioAtLeast: value/baseline must be >= the limit (rates).
	RatioAtLeast GoalKind = "ratio_at_least"
	// RatioAtMost: value/baseline must be <= the limit (latencies, costs).
	RatioAtMost GoalKind = "ratio_at_most"
	// ValueAtMost: the value itself must be <= the limit, in the figure's unit.
	ValueAtMost GoalKind = "value_at_most"
	// ValueAtLeast: the value itself must be >= the limit, in the figure's unit.
	ValueAtLeast GoalKind = "value_at_least"
)

// Goal is a figure's target (docs/guarantees.md, "Performance goals").
type Goal struct {
	Kind  GoalKind `json:"kind,omitempty"`
	Limit float64  `json:"limit,omitempty"`
}

// String renders the goal for the table, e.g. ">= 0.80x" or "<= 25 ms".
func (g Goal) String(unit string) string {
	switch g.Kind {
	case RatioAtLeast:
		return fmt.Sprintf(">= %.2fx", g.Limit)
	case RatioAtMost:
		return fmt.Sprintf("<= %.2fx", g.Limit)
	case ValueAtMost:
		return fmt.Sprintf("<= %s %s", formatNumber(g.Limit), unit)
	case ValueAtLeast:
		return fmt.Sprintf(">= %s %s", formatNumber(g.Limit), unit)
	default:
		return "-"
	}
}

// Figure is one measured number against its baseline measured in the same run.
type Figure struct {
	// Name identifies the figure, e.g. "relay_drain_1_relay".
	Name string `json:"name"`
	// Unit of Value and Baseline, e.g. "events/s" or "ms".
	Unit string `json:"unit"`
	// Value is the measured figure; Baseline the same measure on the baseline.
	Value    float64 `json:"value"`
	Baseline float64 `json:"baseline"`
	// Ratio is Value/Baseline; null when the baseline is zero.
	Ratio *float64 `json:"ratio"`
	// Goal and GoalText say what the figure must reach; Met whether it did
	// (null when the figure has no goal).
	Goal     Goal   `json:"goal"`
	GoalText string `json:"goal_text"`
	Met      *bool  `json:"met"`
	// Measures and BaselineIs describe both sides in words.
	Measures   string `json:"measures"`
	BaselineIs string `json:"baseline_is"`
	// Load1Start and Load1End are the machine's one-minute load average
	// (/proc/loadavg) when the figure's measurement began and ended: a figure
	// measured on a busy machine says so.
	Load1Start *float64 `json:"load1_start,omitempty"`
	Load1End   *float64 `json:"load1_end,omitempty"`
	// Details holds the raw samples behind the figure (per repetition,
	// percentiles, table statistics...).
	Details map[string]any `json:"details,omitempty"`
}

// newFigure fills Ratio, GoalText and Met from the other fields.
func newFigure(name, unit string, value, baseline float64, goal Goal, measures, baselineIs string, details map[string]any) Figure {
	f := Figure{
		Name: name, Unit: unit, Value: round(value), Baseline: round(baseline),
		Goal: goal, GoalText: goal.String(unit), Measures: measures, BaselineIs: baselineIs, Details: details,
	}
	if baseline > 0 && !math.IsInf(value, 0) && !math.IsNaN(value) {
		r := round(value / baseline)
		f.Ratio = &r
	}
	if goal.Kind != GoalNone {
		var met bool
		switch goal.Kind {
		case RatioAtLeast:
			met = f.Ratio != nil && value/baseline >= goal.Limit
		case RatioAtMost:
			met = f.Ratio != nil && value/baseline <= goal.Limit
		case ValueAtMost:
			met = value <= goal.Limit
		case ValueAtLeast:
			met = value >= goal.Limit
		}
		f.Met = &met
	}
	return f
}

// round keeps 4 significant decimals, enough for any figure and stable in JSON.
func round(x float64) float64 {
	if x == 0 || math.IsNaN(x) || math.IsInf(x, 0) {
		return x
	}
	return math.Round(x*1e4) / 1e4
}

// Report is what one run of the benchmark writes.
type Report struct {
	StartedAt time.Time `json:"started_at"`
	// DurationSeconds is the wall time of the whole run.
	DurationSeconds float64  `json:"duration_seconds"`
	Machine         Machine  `json:"machine"`
	Figures         []Figure `json:"figures"`
	// Errors lists the figures that could not be measured, with the reason.
	Errors []string `json:"errors,omitempty"`
}

// Machine describes where the run happened.
type Machine struct {
	NumCPU     int    `json:"nproc"`
	MemoryMiB  int64  `json:"memory_mib"`
	CPUModel   string `json:"cpu_model,omitempty"`
	Kernel     string `json:"kernel,omitempty"`
	LoadAvg    string `json:"loadavg_at_start,omitempty"`
	Go         string `json:"go"`
	PostgreSQL string `json:"postgresql"`
	// PostgreSQLSettings are the server settings that move these figures.
	PostgreSQLSettings map[string]string `json:"postgresql_settings,omitempty"`
	RabbitMQ           string            `json:"rabbitmq"`
	FerretDB           string            `json:"ferretdb,omitempty"`
}

// writeJSON writes r to path, atomically (a temporary file renamed over it).
func writeJSON(path string, r Report) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode report: %w", err)
	}
	b = append(b, '\n')
	tmp, err := os.CreateTemp(filepath.Dir(path), ".bench-*.json")
	if err != nil {
		return fmt.Errorf("write report: %w", err)
	}
	if _, err := tmp.Write(b); err != nil {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("write report: %w", err)
	}
	if err := tmp.Close(); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("write report: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("write report: %w", err)
	}
	return nil
}

// writeTable prints the figures as an aligned table, followed by the errors.
func writeTable(w io.Writer, r Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tunit\tvalue\tbaseline\tratio\tgoal\tverdict\tload1")
	for _, f := range r.Figures {
		ratio := "-"
		if f.Ratio != nil {
			ratio = fmt.Sprintf("%.2fx", *f.Ratio)
		}
		verdict := "-"
		if f.Met != nil {
			verdict = "MISSED"
			if *f.Met {
				verdict = "met"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", f.Name, f.Unit,
			formatNumber(f.Value), formatNumber(f.Baseline), ratio, f.GoalText, verdict, f.loadText())
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, e := range r.Errors {
		if _, err := fmt.Fprintln(w, "error:", e); err != nil {
			return err
		}
	}
	return nil
}

// loadText is the load column: the one-minute load average at the start and
// at the end of the figure, "-" where it was not read.
func (f Figure) loadText() string {
	if f.Load1Start == nil || f.Load1End == nil {
		return "-"
	}
	return fmt.Sprintf("%.2f-%.2f", *f.Load1Start, *f.Load1End)
}

// formatNumber prints rates without decimals and small values with enough
// of them to be read: 33012, 4.21, 0.387.
func formatNumber(x float64) string {
	switch ax := math.Abs(x); {
	case ax >= 1000:
		return fmt.Sprintf("%.0f", x)
	case ax >= 100:
		return fmt.Sprintf("%.1f", x)
	case ax >= 1:
		return fmt.Sprintf("%.2f", x)
	default:
		return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.3f", x), "0"), ".")
	}
}

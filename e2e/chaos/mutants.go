package chaos

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Mutant is a planted bug of `make chaos-mutants`: the proof that the chaos
// proof can fail. Each is built into the service binaries with its build tag
// (Tag), which flips one constant of one package (the file pair
// mutant_<name>.go, mutant_<name>_off.go of Package); a build without the
// tag has none of it.
type Mutant struct {
	// Name is the mutant's name, its tag without the "mutant_" prefix.
	Name string
	// Package is the package holding its hook, from the module's root.
	Package string
	// Bug says what the planted bug does.
	Bug string
	// RelayMode is CHAOS_RELAY_MODE for its run: "wal" for a bug of the WAL
	// relay, "" (the polling relay) for the others.
	RelayMode string
}

// Tag is the build tag that plants the bug.
func (m Mutant) Tag() string { return "mutant_" + m.Name }

// Mutants lists the planted bugs, in the order make chaos-mutants runs them.
func Mutants() []Mutant {
	return []Mutant{
		{Name: "inbox_nodedup", Package: "pkg/inbox",
			Bug: "the inbox records without deduplicating: IsDone is always false, the done cache is never read"},
		{Name: "inbox_recordfirst", Package: "pkg/inbox",
			Bug: "the standalone inbox records a message done, then runs its handler"},
		{Name: "relay_markfirst", Package: "pkg/outbox",
			Bug: "the polling relay marks a batch published, then publishes it without reading the broker's verdicts"},
		{Name: "orders_ackfirst", Package: "services/orders/internal/postgres",
			Bug: "the API answers 201 before the transaction commits, then commits 200ms later (or not)"},
		{Name: "wal_ackpast", Package: "pkg/outbox/outboxwal", RelayMode: "wal",
			Bug: "the WAL relay acknowledges the slot past events the broker has not confirmed"},
		{Name: "relay_reorder", Package: "pkg/outbox",
			Bug: "the polling relay publishes each batch in reverse: an aggregate's runs go out newest first"},
		{Name: "shipping_ackfirst", Package: "services/shipping/internal/rabbitmq",
			Bug: "the consumer acknowledges each delivery as it arrives, before the handler and the inbox record"},
	}
}

// MutantRun is what one mutant's chaos run left: its report, or why there is
// none.
type MutantRun struct {
	Mutant Mutant
	// Report is the run's report; nil when the run wrote none.
	Report *Report
	// Err says why there is no report (the run failed before the checker).
	Err string
}

// Catches tells whether a violation counts as catching a planted bug: a
// broken invariant of the data (I1, I2, I3, I6) or events that never arrived
// (I5 not_drained). A missing fault kind (coverage), a run without
// duplicates (I4) and a slow drain (I5 drain_too_slow) say something of the
// run, not of the bug, and load on a shared machine can cause them.
func Catches(v Violation) bool {
	switch v.Invariant {
	case "I1", "I2", "I3", "I6":
		return true
	case "I5":
		return v.Kind == "not_drained"
	}
	return false
}

// Caught tells whether the run caught its mutant, and lists the violations
// it saw by invariant and kind with their counts (those that do not count as
// catching it marked so).
func (r MutantRun) Caught() (bool, []string) {
	if r.Report == nil {
		return false, nil
	}
	counts := make(map[string]int)
	caught := false
	for _, v := range r.Report.Violations {
		key := v.Invariant + " " + v.Kind
		if !Catches(v) {
			key += " (not counted)"
		}
		counts[key]++
		caught = caught || Catches(v)
	}
	var kinds []string
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		kinds = append(kinds, k+" ×"+strconv.Itoa(counts[k]))
	}
	if listed := len(r.Report.Violations); r.Report.ViolationCount > listed {
		kinds = append(kinds, fmt.Sprintf("(%d more not listed in the report)", r.Report.ViolationCount-listed))
	}
	return caught, kinds
}

// MutantTable is the matrix: one row per run, with its seed, whether it
// caught its mutant, and the violations it saw.
func MutantTable(runs []MutantRun) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "MUTANT\tSEED\tCAUGHT\tINVARIANTS / VIOLATION KINDS")
	for _, r := range runs {
		seed := "-"
		if r.Report != nil {
			seed = strconv.FormatInt(r.Report.Seed, 10)
		}
		caught, kinds := r.Caught()
		verdict := "no"
		if caught {
			verdict = "yes"
		}
		seen := strings.Join(kinds, ", ")
		switch {
		case r.Report == nil:
			seen = "no report: " + cmp.Or(r.Err, "the run wrote none")
		case seen == "":
			seen = "none: every invariant held"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", r.Mutant.Name, seed, verdict, seen)
	}
	_ = w.Flush()
	return b.String()
}

// Escaped lists the mutants of runs that were not caught.
func Escaped(runs []MutantRun) []string {
	var out []string
	for _, r := range runs {
		if caught, _ := r.Caught(); !caught {
			out = append(out, r.Mutant.Name)
		}
	}
	return out
}

// ReadReport reads a report WriteReport wrote.
func ReadReport(path string) (Report, error) {
	var r Report
	b, err := os.ReadFile(path)
	if err != nil {
		return r, fmt.Errorf("read chaos report: %w", err)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("read chaos report %s: %w", path, err)
	}
	return r, nil
}

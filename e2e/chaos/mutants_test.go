package chaos

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestMutantRunCaught(t *testing.T) {
	lost := Violation{Invariant: "I2", Kind: "lost"}
	cases := []struct {
		name   string
		report *Report
		caught bool
		kinds  []string
	}{
		{"no report", nil, false, nil},
		{"every invariant held", &Report{Seed: 7, OK: true}, false, nil},
		{"a lost event", &Report{ViolationCount: 2, Violations: []Violation{lost, lost}}, true, []string{"I2 lost ×2"}},
		{"never drained", &Report{ViolationCount: 1, Violations: []Violation{{Invariant: "I5", Kind: "not_drained"}}}, true, []string{"I5 not_drained ×1"}},
		{"only what the run did", &Report{ViolationCount: 3, Violations: []Violation{
			{Invariant: "coverage", Kind: "fault_not_injected"},
			{Invariant: "I4", Kind: "no_duplicates"},
			{Invariant: "I5", Kind: "drain_too_slow"},
		}}, false, []string{"I4 no_duplicates (not counted) ×1", "I5 drain_too_slow (not counted) ×1", "coverage fault_not_injected (not counted) ×1"}},
		{"more than listed", &Report{ViolationCount: 250, Violations: []Violation{{Invariant: "I1", Kind: "acknowledged_not_committed"}, {Invariant: "I3", Kind: "out_of_order"}}},
			true, []string{"I1 acknowledged_not_committed ×1", "I3 out_of_order ×1", "(248 more not listed in the report)"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			caught, kinds := MutantRun{Mutant: Mutants()[0], Report: c.report}.Caught()
			if caught != c.caught || !slices.Equal(kinds, c.kinds) {
				t.Errorf("Caught() = %t, %q; want %t, %q", caught, kinds, c.caught, c.kinds)
			}
		})
	}
}

func TestMutantTableNamesTheEscaped(t *testing.T) {
	ms := Mutants()
	runs := []MutantRun{
		{Mutant: ms[0], Report: &Report{Seed: 11, ViolationCount: 1, Violations: []Violation{{Invariant: "I2", Kind: "duplicate_effect"}}}},
		{Mutant: ms[1], Report: &Report{Seed: 12, OK: true}},
		{Mutant: ms[2], Err: "go test: exit status 1; read chaos report: no such file"},
	}
	table := MutantTable(runs)
	lines := strings.Split(strings.TrimSpace(table), "\n")
	if len(lines) != 4 {
		t.Fatalf("table has %d lines, want a header and 3 rows:\n%s", len(lines), table)
	}
	for i, want := range [][]string{
		{ms[0].Name, "11", "yes", "I2 duplicate_effect ×1"},
		{ms[1].Name, "12", "no", "none: every invariant held"},
		{ms[2].Name, "-", "no", "no report: go test: exit status 1"},
	} {
		for _, w := range want {
			if !strings.Contains(lines[i+1], w) {
				t.Errorf("row %d %q lacks %q", i+1, lines[i+1], w)
			}
		}
	}
	if got, want := Escaped(runs), []string{ms[1].Name, ms[2].Name}; !slices.Equal(got, want) {
		t.Errorf("Escaped = %v, want %v", got, want)
	}
}

func TestMutantsAreDistinct(t *testing.T) {
	seen := make(map[string]bool)
	for _, m := range Mutants() {
		if seen[m.Name] || m.Name == "" || m.Bug == "" || m.Package == "" {
			t.Errorf("mutant %+v: want a unique name, a package and a bug", m)
		}
		seen[m.Name] = true
	}
	if len(seen) != 7 {
		t.Errorf("%d mutants, want the 7 of make chaos-mutants", len(seen))
	}
}

// TestProductionBuildHasNoMutant proves that a build without tags holds no
// planted bug: each mutant's hook is a file pair whose "on" file carries the
// mutant's build constraint, every mutant_*.go file of the repository
// belongs to a listed mutant, and the packages of the service binaries (go
// list -deps, no tags) compile the "off" files only, while the mutant's tag
// swaps them.
func TestProductionBuildHasNoMutant(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skipf("no go command: %v", err)
	}
	root := filepath.Join("..", "..")
	known := make(map[string]bool)
	for _, m := range Mutants() {
		on := filepath.Join(root, m.Package, "mutant_"+m.Name+".go")
		off := filepath.Join(root, m.Package, "mutant_"+m.Name+"_off.go")
		for file, constraint := range map[string]string{on: "//go:build " + m.Tag(), off: "//go:build !" + m.Tag()} {
			b, err := os.ReadFile(file)
			if err != nil {
				t.Errorf("mutant %s: %v", m.Name, err)
				continue
			}
			if first, _, _ := strings.Cut(string(b), "\n"); first != constraint {
				t.Errorf("%s starts with %q, want %q", file, first, constraint)
			}
		}
		known["mutant_"+m.Name+".go"], known["mutant_"+m.Name+"_off.go"] = true, true
	}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && strings.HasPrefix(d.Name(), ".") && path != root {
			return filepath.SkipDir
		}
		if name := d.Name(); !d.IsDir() && strings.HasPrefix(name, "mutant_") && strings.HasSuffix(name, ".go") && !known[name] {
			t.Errorf("%s: a mutant file of no mutant in Mutants()", path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	list := func(t *testing.T, args ...string) map[string][]string {
		t.Helper()
		cmd := exec.Command("go", append([]string{"list"}, args...)...)
		cmd.Dir = root
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list %v: %v\n%s", args, err, stderr.String())
		}
		files := make(map[string][]string) // package dir, from the root -> Go files
		abs, _ := filepath.Abs(root)
		for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
			fields := strings.Fields(line)
			if len(fields) == 0 {
				continue
			}
			rel, err := filepath.Rel(abs, fields[0])
			if err != nil || strings.HasPrefix(rel, "..") {
				continue // outside the module
			}
			files[filepath.ToSlash(rel)] = fields[1:]
		}
		return files
	}
	const format = "{{.Dir}}{{range .GoFiles}} {{.}}{{end}}"
	prod := list(t, "-deps", "-f", format, "./services/orders", "./services/shipping", "./cmd/...")
	for _, m := range Mutants() {
		got, ok := prod[m.Package]
		switch {
		case !ok:
			t.Errorf("mutant %s: %s is no dependency of the service binaries", m.Name, m.Package)
		case slices.Contains(got, "mutant_"+m.Name+".go") || !slices.Contains(got, "mutant_"+m.Name+"_off.go"):
			t.Errorf("mutant %s: the build without tags compiles %v of %s; want its _off file only", m.Name, got, m.Package)
		}
		tagged := list(t, "-tags", m.Tag(), "-f", format, "./"+m.Package)[m.Package]
		if !slices.Contains(tagged, "mutant_"+m.Name+".go") || slices.Contains(tagged, "mutant_"+m.Name+"_off.go") {
			t.Errorf("mutant %s: -tags %s compiles %v of %s; want the mutant's file, not its _off file", m.Name, m.Tag(), tagged, m.Package)
		}
	}
}

// Command mutantmatrix is `make chaos-mutants`: it runs the chaos suite
// (TestChaos, the short profile unless CHAOS_PROFILE says otherwise) once per
// planted bug of chaos.Mutants, each with the service binaries built with
// the bug's tag (CHAOS_BUILD_TAGS) and a report of its own, one run at a
// time, then prints the matrix (mutant, seed, caught, the violations seen)
// and exits 1 unless every mutant was caught.
//
// Run it from the module's root:
//
//	go run ./e2e/chaos/mutantmatrix [-only inbox_nodedup,relay_reorder] [-out e2e/mutant-reports]
//
// Each run's report is <out>/<mutant>.json and its go test output
// <out>/<mutant>.log. The environment is passed on (CHAOS_SEED,
// CHAOS_PROFILE, CHAOS_DURATION ...), but CHAOS_BUILD_TAGS, CHAOS_REPORT
// and CHAOS_RELAY_MODE, which each run sets.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

func main() {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(os.Args[1:], os.Stdout); err != nil {
		log.Error("chaos-mutants", "error", err)
		os.Exit(1)
	}
}

func run(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("mutantmatrix", flag.ContinueOnError)
	only := fs.String("only", "", "comma-separated mutants to run (default: all)")
	out := fs.String("out", filepath.Join("e2e", "mutant-reports"), "directory of the reports and logs")
	goBin := fs.String("go", "go", "the go command")
	timeout := fs.Duration("timeout", 30*time.Minute, "go test -timeout of each run")
	if err := fs.Parse(args); err != nil {
		return err
	}
	mutants, err := pick(chaos.Mutants(), *only)
	if err != nil {
		return err
	}
	dir, err := filepath.Abs(*out)
	if err != nil {
		return fmt.Errorf("report directory: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("report directory: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	var runs []chaos.MutantRun
	for i, m := range mutants {
		fmt.Fprintf(stdout, "=== mutant %d/%d: %s (-tags %s): %s\n", i+1, len(mutants), m.Name, m.Tag(), m.Bug)
		start := time.Now()
		r := runOne(ctx, *goBin, *timeout, dir, m, stdout)
		caught, _ := r.Caught()
		fmt.Fprintf(stdout, "=== mutant %s: caught=%t in %v (log: %s)\n", m.Name, caught, time.Since(start).Round(time.Second), filepath.Join(dir, m.Name+".log"))
		runs = append(runs, r)
		if ctx.Err() != nil {
			break
		}
	}
	fmt.Fprintln(stdout)
	fmt.Fprint(stdout, chaos.MutantTable(runs))
	if escaped := chaos.Escaped(runs); len(escaped) > 0 {
		return fmt.Errorf("%d of %d mutants escaped: %s", len(escaped), len(runs), strings.Join(escaped, ", "))
	}
	if len(runs) < len(mutants) {
		return fmt.Errorf("interrupted after %d of %d mutants", len(runs), len(mutants))
	}
	fmt.Fprintf(stdout, "chaos-mutants PASS: all %d mutants caught\n", len(runs))
	return nil
}

// pick returns the mutants named in only (comma-separated), or all.
func pick(all []chaos.Mutant, only string) ([]chaos.Mutant, error) {
	if only == "" {
		return all, nil
	}
	var out []chaos.Mutant
	for name := range strings.SplitSeq(only, ",") {
		i := slices.IndexFunc(all, func(m chaos.Mutant) bool { return m.Name == strings.TrimSpace(name) })
		if i < 0 {
			return nil, fmt.Errorf("-only: no mutant %q", name)
		}
		out = append(out, all[i])
	}
	return out, nil
}

// runOne runs TestChaos against m's build, its output to <dir>/<name>.log
// (the summary line also to stdout), and reads its report. The test fails
// when the checker finds violations, as it should here: only the report
// decides.
func runOne(ctx context.Context, goBin string, timeout time.Duration, dir string, m chaos.Mutant, stdout io.Writer) chaos.MutantRun {
	run := chaos.MutantRun{Mutant: m}
	reportPath := filepath.Join(dir, m.Name+".json")
	if err := os.Remove(reportPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		run.Err = err.Error()
		return run
	}
	logFile, err := os.Create(filepath.Join(dir, m.Name+".log"))
	if err != nil {
		run.Err = err.Error()
		return run
	}
	defer logFile.Close()

	cmd := exec.CommandContext(ctx, goBin, "test", "-race", "-count=1", "-v", "-run", "^TestChaos$",
		"-timeout", timeout.String(), "./e2e/")
	// go test's interrupt lets the suite run its cleanups (the broker, the
	// processes, the run's databases) before it exits.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 2 * time.Minute
	cmd.Env = append(withoutVars(os.Environ(), "CHAOS_BUILD_TAGS", "CHAOS_REPORT", "CHAOS_RELAY_MODE"),
		"CHAOS_BUILD_TAGS="+m.Tag(), "CHAOS_REPORT="+reportPath)
	if m.RelayMode != "" {
		cmd.Env = append(cmd.Env, "CHAOS_RELAY_MODE="+m.RelayMode)
	}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(logFile, line)
			if strings.HasPrefix(line, "chaos ") || strings.HasPrefix(line, "--- ") || strings.HasPrefix(line, "FAIL") || strings.HasPrefix(line, "ok ") {
				fmt.Fprintln(stdout, "    "+line)
			}
		}
		_, _ = io.Copy(logFile, pr) // a line too long for the scanner: keep the rest
	}()
	err = cmd.Run()
	_ = pw.Close()
	<-copied

	r, rerr := chaos.ReadReport(reportPath)
	if rerr != nil {
		run.Err = fmt.Sprintf("go test: %v; %v", err, rerr)
		return run
	}
	run.Report = &r
	return run
}

// withoutVars returns env without the named variables.
func withoutVars(env []string, names ...string) []string {
	return slices.DeleteFunc(slices.Clone(env), func(kv string) bool {
		name, _, _ := strings.Cut(kv, "=")
		return slices.Contains(names, name)
	})
}

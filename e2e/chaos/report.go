package chaos

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// DefaultReportPath is where the suite writes its report when CHAOS_REPORT is
// unset, relative to the e2e package directory (go test's working directory).
const DefaultReportPath = "chaos-report.json"

// WriteReport writes r as indented JSON to path, creating its directory.
func WriteReport(path string, r Report) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode chaos report: %w", err)
	}
	if dir := filepath.Dir(path); dir != "." {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("write chaos report: %w", err)
		}
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("write chaos report: %w", err)
	}
	return nil
}

// RunIdentity says which run a report is of: enough to tell two reports'
// runs apart and to run one again.
type RunIdentity struct {
	// RelayMode is CHAOS_RELAY_MODE's relay: "polling" (the default) or "wal".
	RelayMode string `json:"relay_mode"`
	// Env holds the environment overrides that were set: every CHAOS_*
	// variable, and CI.
	Env map[string]string `json:"env,omitempty"`
	// KindsRequired are the fault kinds the run had to inject; KindsSkipped
	// those its profile had and this machine could not inject, and why.
	KindsRequired []FaultKind    `json:"kinds_required"`
	KindsSkipped  []SkippedKinds `json:"kinds_skipped,omitempty"`
	Topology      Topology       `json:"topology"`
	// Commit is the tested tree's `git rev-parse HEAD`, with "+dirty" when
	// the work tree had changes; empty when git could not tell.
	Commit string `json:"commit,omitempty"`
}

// SkippedKinds are fault kinds a run left out, and why.
type SkippedKinds struct {
	Kinds  []FaultKind `json:"kinds"`
	Reason string      `json:"reason"`
}

// EnvOverrides picks from environ (os.Environ's form) the variables a run's
// identity records: CHAOS_* and CI. Nothing else: TEST_DATABASE_URL and the
// like may hold credentials.
func EnvOverrides(environ []string) map[string]string {
	out := make(map[string]string)
	for _, kv := range environ {
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "CHAOS_") || k == "CI" {
			out[k] = v
		}
	}
	return out
}

package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// kindSkips is the one path by which a run leaves fault kinds out: it
// drops them from the profile, logs why and keeps the reason for the
// report. A kind left out because the user opted out (optOut, a variable
// set to false) is a choice; one left out for lack of a tool is, under
// CI=true, a failure, as missingDependency makes it.
type kindSkips struct {
	t    testing.TB
	list []chaos.SkippedKinds
}

// without returns p without kinds, for why, recorded. optOut names the
// variable that, set to false, asks for it.
func (s *kindSkips) without(p chaos.Profile, optOut string, why error, kinds ...chaos.FaultKind) chaos.Profile {
	s.t.Helper()
	kinds = slices.DeleteFunc(slices.Clone(kinds), func(k chaos.FaultKind) bool { return !slices.Contains(p.Kinds, k) })
	if len(kinds) == 0 {
		return p
	}
	s.list = append(s.list, chaos.SkippedKinds{Kinds: kinds, Reason: why.Error()})
	msg := fmt.Sprintf("fault kinds %v left out: %v", kinds, why)
	if optOut != "" && os.Getenv(optOut) == "false" {
		s.t.Log(msg)
	} else {
		missingDependency(s.t, false, msg)
	}
	return p.Without(kinds...)
}

// runIdentity names the run for its report.
func runIdentity(sc scenario) chaos.RunIdentity {
	mode := "polling"
	if os.Getenv("CHAOS_RELAY_MODE") == "wal" {
		mode = "wal"
	}
	return chaos.RunIdentity{
		RelayMode: mode, Env: chaos.EnvOverrides(os.Environ()),
		KindsRequired: slices.Clone(sc.profile.Kinds), KindsSkipped: sc.skipped,
		Topology: sc.topo, Commit: gitCommit(),
	}
}

// gitCommit is the tested tree's HEAD, "+dirty" when its work tree has
// changes, "" where git cannot tell (no git, no repository).
func gitCommit() string {
	head, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		return ""
	}
	commit := strings.TrimSpace(string(head))
	status, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output()
	if err != nil || len(strings.TrimSpace(string(status))) > 0 {
		return commit + "+dirty" // a tree git cannot vouch for counts as changed
	}
	return commit
}

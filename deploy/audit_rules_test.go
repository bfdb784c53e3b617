package deploy_test

import (
	"strings"
	"testing"
)

// The loss audit's alerts (rules/audit.yml, for cmd/audit -every) get the
// checks of the other alerts, as a rule set of their own (ruleSets): their
// unit tests pass and catch broken copies, each has a case where it fires
// and one where it stays quiet, and a runbook section. Here: promtool loads
// them through prometheus.yml. The names of the metrics they read are
// checked against the audit's /metrics by cmd/audit's tests.

func TestAuditAlertRulesAreLoadedAndTested(t *testing.T) {
	t.Parallel()
	out, err := runPromtool(t, promDir, "check", "config", "prometheus.yml")
	if err != nil {
		t.Fatalf("promtool check config: %v\n%s", err, out)
	}
	if !strings.Contains(out, "Checking rules/audit.yml") {
		t.Errorf("prometheus.yml does not load rules/audit.yml:\n%s", out)
	}
	out, err = runPromtool(t, promDir, "test", "rules", "tests/audit_test.yml")
	if err != nil || !strings.Contains(out, "SUCCESS") {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
	if sets := ruleSets(t); len(sets["prometheus/rules/audit.yml"]) == 0 {
		t.Errorf("no unit test loads rules/audit.yml: %v", sets)
	}
}

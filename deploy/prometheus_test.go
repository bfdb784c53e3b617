package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// The Prometheus configuration of deploy/prometheus: prometheus.yml scrapes
// the services and loads rules/; tests/alerts_test.yml holds the rules' unit
// tests; docs/operations.md is the runbook every alert links to.
const (
	promDir       = "prometheus"
	promConfig    = "prometheus/prometheus.yml"
	alertRules    = "prometheus/rules/alerts.yml"
	recordRules   = "prometheus/rules/recording.yml"
	ruleTests     = "prometheus/tests/alerts_test.yml"
	runbook       = "../docs/operations.md"
	runbookPrefix = "docs/operations.md#"
)

// promtool returns the path of promtool (Debian package prometheus, which
// .ci/run installs): the test skips without it, and fails under CI=true.
func promtool(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	if _, err := os.Stat("/usr/bin/promtool"); err == nil {
		return "/usr/bin/promtool"
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("promtool not found (required under CI=true; Debian package prometheus)")
	}
	t.Skip("promtool not found: install the Debian package prometheus to check the rules")
	return ""
}

func runPromtool(t *testing.T, dir string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// ruleFile is a Prometheus rule file.
type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []rule `yaml:"rules"`
	} `yaml:"groups"`
}

type rule struct {
	Alert       string            `yaml:"alert"`
	Record      string            `yaml:"record"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func readRules(t *testing.T, path string) []rule {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var f ruleFile
	if err := yaml.Unmarshal(raw, &f); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	var rules []rule
	for _, g := range f.Groups {
		rules = append(rules, g.Rules...)
	}
	if len(rules) == 0 {
		t.Fatalf("%s has no rules", path)
	}
	return rules
}

// ruleTestFile is the part of a promtool test file the checks read.
type ruleTestFile struct {
	RuleFiles []string `yaml:"rule_files"`
	Tests     []struct {
		Name          string          `yaml:"name"`
		AlertRuleTest []alertRuleTest `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

type alertRuleTest struct {
	Alertname string `yaml:"alertname"`
	ExpAlerts []any  `yaml:"exp_alerts"`
}

func TestPrometheusConfigAndRulesAreValid(t *testing.T) {
	t.Parallel()
	// check config loads the rule files the config names, and checks them.
	out, err := runPromtool(t, promDir, "check", "config", "prometheus.yml")
	if err != nil {
		t.Fatalf("promtool check config: %v\n%s", err, out)
	}
	for _, f := range []string{"rules/recording.yml", "rules/alerts.yml"} {
		if !strings.Contains(out, "Checking "+f) {
			t.Errorf("prometheus.yml does not load %s:\n%s", f, out)
		}
	}
	out, err = runPromtool(t, promDir, "check", "rules", "rules/recording.yml", "rules/alerts.yml")
	if err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
	// promtool must reject what it is given to reject, or the two checks
	// above prove nothing.
	bad := filepath.Join(t.TempDir(), "bad.yml")
	if err := os.WriteFile(bad, []byte("groups:\n  - name: x\n    rules:\n      - record: x:y\n        expr: sum(rate(foo[5m])\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := runPromtool(t, ".", "check", "rules", bad); err == nil {
		t.Fatalf("promtool check rules accepted an unbalanced expression:\n%s", out)
	}
}

func TestAlertRuleUnitTests(t *testing.T) {
	t.Parallel()
	out, err := runPromtool(t, promDir, "test", "rules", "tests/alerts_test.yml")
	if err != nil || !strings.Contains(out, "SUCCESS") {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
}

// Every alert has a unit test where it fires and one where it stays quiet,
// with annotations pointing at its section of the runbook; no test names an
// alert that does not exist (promtool would pass it, finding none).
func TestEveryAlertIsTestedAndHasARunbook(t *testing.T) {
	t.Parallel()
	everyAlertIsTestedAndHasARunbook(t, alertRules, ruleTests)
}

// everyAlertIsTestedAndHasARunbook checks the alerting rules in alertRules
// against their unit tests in ruleTests.
func everyAlertIsTestedAndHasARunbook(t *testing.T, alertRules, ruleTests string) {
	t.Helper()
	alerts := map[string]rule{}
	for _, r := range readRules(t, alertRules) {
		if r.Alert == "" {
			t.Errorf("%s holds a recording rule %q: keep them in %s", alertRules, r.Record, recordRules)
			continue
		}
		if _, dup := alerts[r.Alert]; dup {
			t.Errorf("alert %s is defined twice", r.Alert)
		}
		alerts[r.Alert] = r
	}
	for _, r := range readRules(t, recordRules) {
		if r.Record == "" || !regexp.MustCompile(`^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$`).MatchString(r.Record) {
			t.Errorf("%s: %q is not a recording rule named level:metric:operations", recordRules, r.Record+r.Alert)
		}
	}

	raw, err := os.ReadFile(ruleTests)
	if err != nil {
		t.Fatal(err)
	}
	var tf ruleTestFile
	if err := yaml.Unmarshal(raw, &tf); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"../rules/recording.yml", "../" + strings.TrimPrefix(alertRules, promDir+"/")} {
		if !slices.Contains(tf.RuleFiles, want) {
			t.Errorf("%s does not load %s", ruleTests, want)
		}
	}
	fires, quiet := map[string]int{}, map[string]int{}
	for _, tc := range tf.Tests {
		for _, a := range tc.AlertRuleTest {
			if _, ok := alerts[a.Alertname]; !ok {
				t.Errorf("test %q checks alert %q, which %s does not define", tc.Name, a.Alertname, alertRules)
			}
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname]++
			} else {
				quiet[a.Alertname]++
			}
		}
	}

	doc, err := os.ReadFile(runbook)
	if err != nil {
		t.Fatalf("the runbook: %v", err)
	}
	anchors := markdownAnchors(string(doc))
	for name, r := range alerts {
		if fires[name] == 0 {
			t.Errorf("alert %s has no unit test where it fires", name)
		}
		if quiet[name] == 0 {
			t.Errorf("alert %s has no unit test where it stays quiet", name)
		}
		if s := r.Labels["severity"]; !slices.Contains([]string{"critical", "warning", "info"}, s) {
			t.Errorf("alert %s: severity %q, want critical, warning or info", name, s)
		}
		if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
			t.Errorf("alert %s: want a summary and a description", name)
		}
		url := r.Annotations["runbook_url"]
		if want := runbookPrefix + strings.ToLower(name); url != want {
			t.Errorf("alert %s: runbook_url %q, want %q", name, url, want)
		}
		if !anchors[strings.ToLower(name)] {
			t.Errorf("alert %s: %s has no section titled %s", name, runbook, name)
		}
	}
}

// markdownAnchors returns the anchors GitHub gives the headings of a
// Markdown document (lower case, punctuation dropped, spaces as dashes).
func markdownAnchors(doc string) map[string]bool {
	anchors := map[string]bool{}
	drop := regexp.MustCompile(`[^\p{L}\p{N} _-]`)
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimSpace(strings.TrimLeft(line, "#"))
		h = drop.ReplaceAllString(strings.ToLower(h), "")
		anchors[strings.ReplaceAll(h, " ", "-")] = true
	}
	return anchors
}

// The unit tests can fail: for each alert, promtool test rules runs its
// tests against two broken copies of the rules, one where the alert never
// fires and one where it always fires, and both must fail.
func TestAlertRuleUnitTestsCatchBrokenAlerts(t *testing.T) {
	t.Parallel()
	brokenAlertsAreCaught(t, alertRules, ruleTests)
}

// brokenAlertsAreCaught checks that the unit tests in ruleTests catch
// broken copies of each alert of alertRules.
func brokenAlertsAreCaught(t *testing.T, alertRules, ruleTests string) {
	t.Helper()
	raw, err := os.ReadFile(alertRules)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := filepath.Abs(recordRules)
	if err != nil {
		t.Fatal(err)
	}
	testsRaw, err := os.ReadFile(ruleTests)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	type mutant struct{ alert, kind, file string }
	var mutants []mutant
	var files []string
	for _, r := range readRules(t, alertRules) {
		for kind, expr := range map[string]string{"never": "vector(1) > 2", "always": "vector(1)"} {
			var doc yaml.Node
			if err := yaml.Unmarshal(raw, &doc); err != nil {
				t.Fatal(err)
			}
			if !setAlertExpr(&doc, r.Alert, expr) {
				t.Fatalf("alert %s not found in the YAML tree", r.Alert)
			}
			out, err := yaml.Marshal(&doc)
			if err != nil {
				t.Fatal(err)
			}
			base := filepath.Join(dir, r.Alert+"-"+kind)
			if err := os.WriteFile(base+".rules.yml", out, 0o644); err != nil {
				t.Fatal(err)
			}
			// Only the alert's own tests, with the broken copy: all of them
			// for each of the 2 x alerts copies would take minutes.
			tests := testsOf(t, testsRaw, r.Alert, rec, base+".rules.yml")
			if err := os.WriteFile(base+".test.yml", tests, 0o644); err != nil {
				t.Fatal(err)
			}
			mutants = append(mutants, mutant{r.Alert, kind, base + ".test.yml"})
			files = append(files, base+".test.yml")
		}
	}
	// One promtool run for all of them; it reports each file in turn.
	out, _ := runPromtool(t, dir, append([]string{"test", "rules"}, files...)...)
	for _, m := range mutants {
		i := strings.Index(out, "Unit Testing:  "+m.file)
		if i < 0 {
			t.Errorf("promtool did not report %s:\n%s", m.file, out)
			continue
		}
		section := out[i+len("Unit Testing:  "+m.file):]
		if j := strings.Index(section, "Unit Testing:  "); j >= 0 {
			section = section[:j]
		}
		if !strings.Contains(section, "FAILED") {
			t.Errorf("alert %s: its unit tests pass with an alert that %s fires", m.alert, m.kind)
		}
	}
}

// testsOf returns the promtool test file raw with only the test groups that
// check alert, loading the rule files rec and alerts.
func testsOf(t *testing.T, raw []byte, alert, rec, alerts string) []byte {
	t.Helper()
	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	root := doc.Content[0]
	for i := 0; i+1 < len(root.Content); i += 2 {
		v := root.Content[i+1]
		switch root.Content[i].Value {
		case "rule_files":
			v.Content = []*yaml.Node{
				{Kind: yaml.ScalarNode, Value: rec},
				{Kind: yaml.ScalarNode, Value: alerts},
			}
		case "tests":
			v.Content = slices.DeleteFunc(v.Content, func(tc *yaml.Node) bool {
				var g struct {
					AlertRuleTest []alertRuleTest `yaml:"alert_rule_test"`
				}
				if err := tc.Decode(&g); err != nil {
					t.Fatal(err)
				}
				return !slices.ContainsFunc(g.AlertRuleTest, func(a alertRuleTest) bool { return a.Alertname == alert })
			})
		}
	}
	out, err := yaml.Marshal(&doc)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// setAlertExpr replaces the expr of the alert named name in a rule file's
// YAML tree, and reports whether it found it.
func setAlertExpr(n *yaml.Node, name, expr string) bool {
	if n.Kind == yaml.MappingNode {
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == "alert" && n.Content[i+1].Value == name {
				for j := 0; j+1 < len(n.Content); j += 2 {
					if n.Content[j].Value == "expr" {
						n.Content[j+1].Value = expr
						return true
					}
				}
			}
		}
	}
	for _, c := range n.Content {
		if setAlertExpr(c, name, expr) {
			return true
		}
	}
	return false
}

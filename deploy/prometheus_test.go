package deploy_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// The Prometheus configuration of deploy/prometheus: prometheus.yml scrapes
// the services and loads rules/; tests/alerts_test.yml holds the rules' unit
// tests; docs/operations.md is the runbook every alert links to.
const (
	promDir     = "prometheus"
	promConfig  = "prometheus/prometheus.yml"
	alertRules  = "prometheus/rules/alerts.yml"
	recordRules = "prometheus/rules/recording.yml"
	// ruleTestsGlob are the rules' unit tests: evaluated every minute, and,
	// for the alerts whose windows span hours, every 5 minutes.
	ruleTestsGlob = "prometheus/tests/*_test.yml"
	runbook       = "../docs/operations.md"
	// runbookBase is where the runbook is published: every runbook_url is
	// this, "#", and the alert's name in lower case. The runbook states it.
	runbookBase = "https://github.com/outbox-inbox/reference/blob/main/docs/operations.md"
)

// alwaysFiring are the alerts that fire all the time by design: they have
// no test where they stay quiet.
var alwaysFiring = map[string]bool{"Watchdog": true}

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
	Groups []ruleGroup `yaml:"groups"`
}

type ruleGroup struct {
	Name  string `yaml:"name"`
	Rules []rule `yaml:"rules"`
}

type rule struct {
	Alert       string            `yaml:"alert,omitempty"`
	Record      string            `yaml:"record,omitempty"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for,omitempty"`
	Labels      map[string]string `yaml:"labels,omitempty"`
	Annotations map[string]string `yaml:"annotations,omitempty"`
	group       string            // the group's name
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
		for _, r := range g.Rules {
			r.group = g.Name
			rules = append(rules, r)
		}
	}
	if len(rules) == 0 {
		t.Fatalf("%s has no rules", path)
	}
	return rules
}

// ruleTestFiles returns the rules' unit test files.
func ruleTestFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(ruleTestsGlob)
	if err != nil || len(files) == 0 {
		t.Fatalf("no rule tests match %s: %v", ruleTestsGlob, err)
	}
	return files
}

// ruleSets groups the unit test files by the alerting rules they test: each
// loads recording.yml and one file of alerts (rules/alerts.yml, or
// rules/audit.yml for the loss audit's). The keys are paths like alertRules.
func ruleSets(t *testing.T) map[string][]string {
	t.Helper()
	sets := map[string][]string{}
	for _, f := range ruleTestFiles(t) {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var tf ruleTestFile
		if err := yaml.Unmarshal(raw, &tf); err != nil {
			t.Fatal(err)
		}
		var alertFiles []string
		for _, rf := range tf.RuleFiles {
			if rf != "../rules/recording.yml" {
				alertFiles = append(alertFiles, filepath.Join(promDir, strings.TrimPrefix(rf, "../")))
			}
		}
		if !slices.Contains(tf.RuleFiles, "../rules/recording.yml") || len(alertFiles) != 1 {
			t.Fatalf("%s loads %v: want ../rules/recording.yml and one file of alerts", f, tf.RuleFiles)
		}
		sets[alertFiles[0]] = append(sets[alertFiles[0]], f)
	}
	if len(sets[alertRules]) == 0 {
		t.Fatalf("no unit test loads %s", alertRules)
	}
	return sets
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
	files := ruleTestFiles(t)
	for i, f := range files {
		files[i] = filepath.Base(f)
	}
	out, err := runPromtool(t, filepath.Join(promDir, "tests"), append([]string{"test", "rules"}, files...)...)
	if err != nil || strings.Count(out, "SUCCESS") != len(files) {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
}

// Every alert has a unit test where it fires and one where it stays quiet,
// with annotations pointing at its section of the runbook; no test names an
// alert that does not exist (promtool would pass it, finding none).
func TestEveryAlertIsTestedAndHasARunbook(t *testing.T) {
	t.Parallel()
	for alertRules, tests := range ruleSets(t) {
		t.Run(filepath.Base(alertRules), func(t *testing.T) { everyAlertIsTestedAndHasARunbook(t, alertRules, tests) })
	}
}

// everyAlertIsTestedAndHasARunbook checks the alerts of alertRules against
// their unit tests.
func everyAlertIsTestedAndHasARunbook(t *testing.T, alertRules string, tests []string) {
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

	fires, quiet := map[string]int{}, map[string]int{}
	for _, f := range tests {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var tf ruleTestFile
		if err := yaml.Unmarshal(raw, &tf); err != nil {
			t.Fatal(err)
		}
		for _, tc := range tf.Tests {
			for _, a := range tc.AlertRuleTest {
				if _, ok := alerts[a.Alertname]; !ok {
					t.Errorf("%s: test %q checks alert %q, which %s does not define", f, tc.Name, a.Alertname, alertRules)
				}
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname]++
				} else {
					quiet[a.Alertname]++
				}
			}
		}
	}

	doc, err := os.ReadFile(runbook)
	if err != nil {
		t.Fatalf("the runbook: %v", err)
	}
	anchors := markdownAnchors(string(doc))
	if !strings.Contains(string(doc), runbookBase) {
		t.Errorf("%s does not state the runbook's base URL %s", runbook, runbookBase)
	}
	for name, r := range alerts {
		if fires[name] == 0 {
			t.Errorf("alert %s has no unit test where it fires", name)
		}
		if quiet[name] == 0 && !alwaysFiring[name] {
			t.Errorf("alert %s has no unit test where it stays quiet", name)
		}
		severities := []string{"critical", "warning", "info"}
		if alwaysFiring[name] {
			severities = []string{"none"} // routed to a dead man's switch, never to people
		}
		if s := r.Labels["severity"]; !slices.Contains(severities, s) {
			t.Errorf("alert %s: severity %q, want one of %v", name, s, severities)
		}
		if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
			t.Errorf("alert %s: want a summary and a description", name)
		}
		url := r.Annotations["runbook_url"]
		if want := runbookBase + "#" + strings.ToLower(name); url != want {
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

// The unit tests can fail, and they pin every figure of every alert: for
// each alert, promtool test rules runs the alert's own tests against broken
// copies of it, and each copy must make some test fail. The copies: the
// alert never fires; it always fires; each threshold it compares with
// halved and doubled (0 becomes 1 and -1); each of those comparisons
// reversed; each range window and offset halved and doubled; its `for`
// dropped, halved and doubled (none becomes 1m); each job matcher widened to
// any job; each `up == 1` read as `up`; `or on () absent(M)` added for each
// metric M it reads (not already under absent()); and, in each recording
// rule it reads, each window halved and doubled wherever the rule uses it
// (a recorded ratio's two rates share a window), each job matcher widened
// and each `up == 1` read as `up`. It logs the copies made and caught, by
// kind.
// Each copy is loaded alone, with the recording rules it reads, so that
// promtool evaluates one alert, not all of them.
func TestAlertRuleUnitTestsCatchBrokenAlerts(t *testing.T) {
	t.Parallel()
	for alertRules, tests := range ruleSets(t) {
		t.Run(filepath.Base(alertRules), func(t *testing.T) { brokenAlertsAreCaught(t, alertRules, tests) })
	}
}

// brokenAlertsAreCaught checks that the unit tests catch broken copies of
// each alert of alertRules.
func brokenAlertsAreCaught(t *testing.T, alertRules string, tests []string) {
	recorded := map[string]rule{}
	for _, r := range readRules(t, recordRules) {
		recorded[r.Record] = r
	}
	testFiles := map[string][]byte{}
	for _, f := range tests {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		testFiles[f] = raw
	}
	dir := t.TempDir()
	type mutantFiles struct {
		mutation
		files []string // its test files: one failing is enough
	}
	var mutants []mutantFiles
	var all []string
	for _, r := range readRules(t, alertRules) {
		ms := alertMutations(t, r)
		names, err := metricNames(r.Expr)
		if err != nil {
			t.Fatal(err)
		}
		var reads []rule
		for _, n := range names {
			if rr, ok := recorded[n]; ok {
				reads = append(reads, rr)
				ms = append(ms, recordingMutations(t, r.Alert, rr)...)
			}
		}
		for i, m := range ms {
			base := filepath.Join(dir, fmt.Sprintf("%s-%d", r.Alert, i))
			broken := r
			var rec []rule
			for _, rr := range reads {
				if rr.Record == m.record {
					rr.Expr = m.expr
				}
				rec = append(rec, rr)
			}
			if m.record == "" {
				broken.Expr = m.expr
				if m.forDur != nil {
					broken.For = *m.forDur
				}
			}
			groups := []ruleGroup{{Name: r.group, Rules: []rule{broken}}}
			order := []string{r.group}
			if len(rec) > 0 {
				groups = append([]ruleGroup{{Name: rec[0].group, Rules: rec}}, groups...)
				order = append([]string{rec[0].group}, order...)
			}
			writeYAML(t, base+".rules.yml", ruleFile{Groups: groups})
			mf := mutantFiles{mutation: m}
			for src, raw := range testFiles {
				tests, ok := testsOf(t, raw, r.Alert, base+".rules.yml", order)
				if !ok {
					continue
				}
				f := base + "." + filepath.Base(src)
				if err := os.WriteFile(f, tests, 0o644); err != nil {
					t.Fatal(err)
				}
				mf.files = append(mf.files, f)
				all = append(all, f)
			}
			if len(mf.files) == 0 {
				t.Fatalf("alert %s has no unit test", r.Alert)
			}
			mutants = append(mutants, mf)
		}
	}
	// One promtool run for all of them; it reports each file in turn.
	t.Logf("%d broken copies of the alerts, %d test files", len(mutants), len(all))
	out, _ := runPromtool(t, dir, append([]string{"test", "rules"}, all...)...)
	total, caughtBy := map[string]int{}, map[string]int{}
	defer func() {
		var kinds []string
		for k := range total {
			kinds = append(kinds, fmt.Sprintf("%s %d/%d", k, caughtBy[k], total[k]))
		}
		slices.Sort(kinds)
		n, c := 0, 0
		for k := range total {
			n, c = n+total[k], c+caughtBy[k]
		}
		t.Logf("%s: %d of %d broken copies caught (%s)", alertRules, c, n, strings.Join(kinds, ", "))
	}()
	for _, m := range mutants {
		total[m.kind]++
		caught := false
		for _, f := range m.files {
			i := strings.Index(out, "Unit Testing:  "+f)
			if i < 0 {
				t.Fatalf("promtool did not report %s:\n%s", f, out)
			}
			section := out[i+len("Unit Testing:  "+f):]
			if j := strings.Index(section, "Unit Testing:  "); j >= 0 {
				section = section[:j]
			}
			caught = caught || strings.Contains(section, "FAILED")
		}
		if !caught {
			t.Errorf("alert %s: its unit tests pass when %s", m.alert, m.what)
		} else {
			caughtBy[m.kind]++
		}
	}
}

func writeYAML(t *testing.T, path string, v any) {
	t.Helper()
	out, err := yaml.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// mutation is a broken copy of one alert: its expression and its `for`
// (nil: unchanged), or, when record is set, the expression of the recording
// rule record that it reads.
type mutation struct {
	alert, what string
	kind        string // for the count by kind: threshold, window, for, ...
	expr        string
	forDur      *string
	record      string
}

var (
	// A comparison with a number literal: the alert's threshold.
	thresholdRe = regexp.MustCompile(`(>=|<=|==|!=|>|<)\s*(bool\s+)?(-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)`)
	// A range selector's or subquery's range, and an offset.
	windowRe = regexp.MustCompile(`\[(\d+[smhdwy])(?::\d+[smhdwy])?\]|offset\s+(\d+[smhdwy])`)
)

// alertMutations returns the broken copies of r that its tests must catch.
func alertMutations(t *testing.T, r rule) []mutation {
	t.Helper()
	ms := []mutation{{alert: r.Alert, kind: "never fires", what: "it never fires", expr: "vector(1) > 2"}}
	if !alwaysFiring[r.Alert] {
		ms = append(ms, mutation{alert: r.Alert, kind: "always fires", what: "it always fires", expr: "vector(1)"})
	}
	masked := quotedOrBraced(r.Expr)
	for _, loc := range thresholdRe.FindAllStringSubmatchIndex(r.Expr, -1) {
		numStart, numEnd := loc[6], loc[7]
		if masked[loc[0]] || numEnd < len(r.Expr) && isIdentByte(r.Expr[numEnd]) {
			continue
		}
		v, err := strconv.ParseFloat(r.Expr[numStart:numEnd], 64)
		if err != nil {
			t.Fatalf("alert %s: threshold %q: %v", r.Alert, r.Expr[numStart:numEnd], err)
		}
		alts := []float64{v / 2, v * 2}
		if v == 0 {
			alts = []float64{1, -1}
		}
		op := r.Expr[loc[2]:loc[3]]
		for _, a := range alts {
			n := strconv.FormatFloat(a, 'g', -1, 64)
			ms = append(ms, mutation{alert: r.Alert, kind: "threshold",
				what: fmt.Sprintf("%s %s becomes %s %s", op, r.Expr[numStart:numEnd], op, n),
				expr: r.Expr[:numStart] + n + r.Expr[numEnd:]})
		}
	}
	// Each comparison with a threshold reversed.
	for _, loc := range thresholdRe.FindAllStringSubmatchIndex(r.Expr, -1) {
		if masked[loc[0]] || loc[7] < len(r.Expr) && isIdentByte(r.Expr[loc[7]]) {
			continue
		}
		op := r.Expr[loc[2]:loc[3]]
		ms = append(ms, mutation{alert: r.Alert, kind: "operator",
			what: fmt.Sprintf("%s becomes %s in %q", op, reversedOp[op], r.Expr[loc[0]:loc[1]]),
			expr: r.Expr[:loc[2]] + reversedOp[op] + r.Expr[loc[3]:]})
	}
	ms = append(ms, selectorMutations(r.Alert, "", r.Expr)...)
	// The alert also fires when a metric it reads is absent.
	if names, err := metricNames(r.Expr); err == nil && !alwaysFiring[r.Alert] {
		for _, n := range names {
			if regexp.MustCompile(`absent\(\s*` + regexp.QuoteMeta(n) + `\b`).MatchString(r.Expr) {
				continue // already there
			}
			ms = append(ms, mutation{alert: r.Alert, kind: "or absent",
				what: fmt.Sprintf("`or on () absent(%s)` is added", n),
				expr: "(" + r.Expr + ") or on () absent(" + n + ")"})
		}
	}
	for _, loc := range windowRe.FindAllStringSubmatchIndex(r.Expr, -1) {
		start, end := loc[2], loc[3]
		if start < 0 {
			start, end = loc[4], loc[5]
		}
		d := promDuration(t, r.Expr[start:end])
		for _, a := range []time.Duration{d / 2, d * 2} {
			n := strconv.Itoa(int(a.Seconds())) + "s"
			ms = append(ms, mutation{alert: r.Alert, kind: "window",
				what: fmt.Sprintf("the window %s becomes %s in %q", r.Expr[start:end], n, r.Expr[loc[0]:loc[1]]),
				expr: r.Expr[:start] + n + r.Expr[end:]})
		}
	}
	var fors []time.Duration
	if r.For == "" {
		fors = []time.Duration{time.Minute}
	} else {
		f := promDuration(t, r.For)
		fors = []time.Duration{0, f * 2}
		// Half of 1m would fire at the same evaluation (every minute in
		// the tests) as 1m itself.
		if f/2 >= time.Minute {
			fors = append(fors, f/2)
		}
	}
	for _, f := range fors {
		n := strconv.Itoa(int(f.Seconds())) + "s"
		ms = append(ms, mutation{alert: r.Alert, kind: "for", what: fmt.Sprintf("for %q becomes %s", r.For, n), forDur: &n})
	}
	for i := range ms {
		if ms[i].expr == "" {
			ms[i].expr = r.Expr
		}
	}
	return ms
}

var (
	// reversedOp is the comparison that holds where op does not.
	reversedOp = map[string]string{">": "<=", "<": ">=", ">=": "<", "<=": ">", "==": "!=", "!=": "=="}
	// A job matcher: widened, it reads another job's series.
	jobMatcherRe = regexp.MustCompile(`\bjob\s*(=~|=)\s*"([^"]*)"`)
	// up filtered to its healthy targets: without the filter, a target
	// scraped but down counts (count(up) for count(up == 1)).
	upHealthyRe = regexp.MustCompile(`\b(up(?:\{[^}]*\})?)\s*==\s*1\b`)
)

// selectorMutations returns the copies of expr (of the alert alert, or of
// the recording rule record it reads) with each job matcher widened to any
// job, and each `up == 1` read as `up`.
func selectorMutations(alert, record, expr string) []mutation {
	var ms []mutation
	where := ""
	if record != "" {
		where = " in the recording rule " + record
	}
	for _, loc := range jobMatcherRe.FindAllStringSubmatchIndex(expr, -1) {
		if expr[loc[4]:loc[5]] == ".+" {
			continue
		}
		ms = append(ms, mutation{alert: alert, record: record, kind: "job matcher",
			what: fmt.Sprintf("%s becomes job=~\".+\"%s", expr[loc[0]:loc[1]], where),
			expr: expr[:loc[0]] + `job=~".+"` + expr[loc[1]:]})
	}
	for _, loc := range upHealthyRe.FindAllStringSubmatchIndex(expr, -1) {
		ms = append(ms, mutation{alert: alert, record: record, kind: "up == 1",
			what: fmt.Sprintf("%s becomes %s%s", expr[loc[0]:loc[1]], expr[loc[2]:loc[3]], where),
			expr: expr[:loc[0]] + expr[loc[2]:loc[3]] + expr[loc[1]:]})
	}
	return ms
}

// recordingMutations returns the copies of the recording rule rr, read by
// alert, with each of its windows halved and doubled wherever it occurs,
// and its selectors mutated as an alert's (selectorMutations).
func recordingMutations(t *testing.T, alert string, rr rule) []mutation {
	t.Helper()
	ms := selectorMutations(alert, rr.Record, rr.Expr)
	seen := map[string]bool{}
	for _, m := range windowRe.FindAllStringSubmatch(rr.Expr, -1) {
		lit := m[1] + m[2]
		if seen[lit] {
			continue
		}
		seen[lit] = true
		d := promDuration(t, lit)
		for _, a := range []time.Duration{d / 2, d * 2} {
			n := strconv.Itoa(int(a.Seconds())) + "s"
			expr := windowRe.ReplaceAllStringFunc(rr.Expr, func(w string) string {
				if sm := windowRe.FindStringSubmatch(w); sm[1]+sm[2] != lit {
					return w
				}
				return strings.Replace(w, lit, n, 1)
			})
			ms = append(ms, mutation{alert: alert, record: rr.Record, expr: expr, kind: "window",
				what: fmt.Sprintf("the window %s becomes %s in the recording rule %s", lit, n, rr.Record)})
		}
	}
	return ms
}

// quotedOrBraced marks the bytes of expr inside quotes or label matchers.
func quotedOrBraced(expr string) []bool {
	m := make([]bool, len(expr))
	var quote byte
	depth := 0
	for i := 0; i < len(expr); i++ {
		c := expr[i]
		switch {
		case quote != 0:
			m[i] = true
			if c == '\\' {
				i++
				if i < len(expr) {
					m[i] = true
				}
			} else if c == quote {
				quote = 0
			}
		case c == '"' || c == '\'' || c == '`':
			quote, m[i] = c, true
		case c == '{':
			depth++
			m[i] = true
		case c == '}':
			depth--
			m[i] = true
		default:
			m[i] = depth > 0
		}
	}
	return m
}

func isIdentByte(c byte) bool {
	return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// promDuration parses a Prometheus duration of one unit (5m, 6h, 1d).
func promDuration(t *testing.T, s string) time.Duration {
	t.Helper()
	units := map[byte]time.Duration{'s': time.Second, 'm': time.Minute, 'h': time.Hour, 'd': 24 * time.Hour, 'w': 7 * 24 * time.Hour, 'y': 365 * 24 * time.Hour}
	n, err := strconv.Atoi(s[:len(s)-1])
	u, ok := units[s[len(s)-1]]
	if err != nil || !ok {
		t.Fatalf("duration %q: want a number and one unit", s)
	}
	return time.Duration(n) * u
}

// testsOf returns the promtool test file raw with only its checks of alert
// (and the groups that hold them), loading the rule file rules evaluated in
// order, and whether raw has any such check.
func testsOf(t *testing.T, raw []byte, alert, rules string, order []string) ([]byte, bool) {
	t.Helper()
	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	root := doc.Content[0]
	found := false
	for i := 0; i+1 < len(root.Content); i += 2 {
		v := root.Content[i+1]
		switch root.Content[i].Value {
		case "rule_files":
			v.Content = []*yaml.Node{{Kind: yaml.ScalarNode, Value: rules}}
		case "group_eval_order":
			v.Content = nil
			for _, g := range order {
				v.Content = append(v.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: g})
			}
		case "tests":
			// In each group only the checks of alert stay: the copy's rule
			// file holds no other alert (a check that another one fires
			// would fail whatever the copy does) and only the recording
			// rules alert reads (the checks of the others' values go too).
			v.Content = slices.DeleteFunc(v.Content, func(tc *yaml.Node) bool {
				kept := false
				for j := 0; j+1 < len(tc.Content); j += 2 {
					switch tc.Content[j].Value {
					case "alert_rule_test":
						checks := tc.Content[j+1]
						checks.Content = slices.DeleteFunc(checks.Content, func(c *yaml.Node) bool {
							var a alertRuleTest
							if err := c.Decode(&a); err != nil {
								t.Fatal(err)
							}
							return a.Alertname != alert
						})
						kept = len(checks.Content) > 0
					case "promql_expr_test":
						tc.Content[j+1].Content = nil
					}
				}
				return !kept
			})
			found = len(v.Content) > 0
		}
	}
	out, err := yaml.Marshal(&doc)
	if err != nil {
		t.Fatal(err)
	}
	return out, found
}

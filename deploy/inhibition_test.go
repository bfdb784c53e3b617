package deploy_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// inhibitionTests are the scenarios of one cause setting off several alerts
// (promtool checks which alerts fire in each).
const inhibitionTests = "prometheus/tests/inhibition_test.yml"

// inhibitionScenario is one test of inhibitionTests: the cause (from its
// name, "Inhibition: CAUSE: ...") and the alerts firing at its last
// evaluation, each as its labels (alertname included).
type inhibitionScenario struct {
	name, cause string
	firing      []map[string]string
}

func readInhibitionScenarios(t *testing.T) []inhibitionScenario {
	t.Helper()
	raw, err := os.ReadFile(inhibitionTests)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Tests []struct {
			Name          string `yaml:"name"`
			AlertRuleTest []struct {
				EvalTime  string `yaml:"eval_time"`
				Alertname string `yaml:"alertname"`
				ExpAlerts []struct {
					ExpLabels map[string]string `yaml:"exp_labels"`
				} `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	if err := yaml.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	var all []string
	for _, r := range readRules(t, alertRules) {
		if !alwaysFiring[r.Alert] {
			all = append(all, r.Alert)
		}
	}
	slices.Sort(all)
	var out []inhibitionScenario
	for _, tc := range f.Tests {
		rest, ok := strings.CutPrefix(tc.Name, "Inhibition: ")
		cause, _, ok2 := strings.Cut(rest, ":")
		if !ok || !ok2 {
			t.Fatalf("%s: test %q is not named \"Inhibition: CAUSE: ...\"", inhibitionTests, tc.Name)
		}
		s := inhibitionScenario{name: tc.Name, cause: cause}
		// Every alert is listed, at one evaluation: the firing ones are then
		// all the alerts that fire.
		var listed []string
		for _, a := range tc.AlertRuleTest {
			if a.EvalTime != tc.AlertRuleTest[0].EvalTime {
				t.Fatalf("%s: %q checks several times: want one", inhibitionTests, tc.Name)
			}
			listed = append(listed, a.Alertname)
			for _, e := range a.ExpAlerts {
				labels := maps.Clone(e.ExpLabels)
				labels["alertname"] = a.Alertname
				s.firing = append(s.firing, labels)
			}
		}
		slices.Sort(listed)
		if !slices.Equal(listed, all) {
			t.Fatalf("%s: %q lists %v, want every alert of %s but Watchdog: %v", inhibitionTests, tc.Name, listed, alertRules, all)
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		t.Fatalf("%s has no scenario", inhibitionTests)
	}
	return out
}

// One cause, one page: in each scenario of inhibition_test.yml, the alerts
// promtool shows firing together are sent to the real Alertmanager run with
// the compose configuration; every one but the cause is inhibited, the
// cause is not, and it is critical, which `amtool config routes test`
// routes to oncall. Without the inhibit rules the scenarios give 2 to 4
// critical alerts each.
func TestAlertmanagerInhibitsTheSymptomsOfOneCause(t *testing.T) {
	t.Parallel()
	bin, err := exec.LookPath("prometheus-alertmanager")
	if err != nil {
		if bin, err = exec.LookPath("alertmanager"); err != nil {
			skipOrFail(t, "alertmanager not found: install the Debian package prometheus-alertmanager")
		}
	}
	config, err := filepath.Abs(alertmanagerConfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range readInhibitionScenarios(t) {
		t.Run(s.cause, func(t *testing.T) {
			t.Parallel()
			var causes, criticals int
			for _, a := range s.firing {
				if a["alertname"] == s.cause {
					causes++
					if a["severity"] != "critical" {
						t.Errorf("%s: the cause has severity %q: want critical, the page", s.name, a["severity"])
					}
					if got := receiverFor(t, alertmanagerConfig, "alertname="+s.cause, "severity="+a["severity"]); got != "oncall" {
						t.Errorf("%s: the cause goes to %q, want oncall", s.name, got)
					}
				}
				if a["severity"] == "critical" {
					criticals++
				}
			}
			if causes != 1 || len(s.firing) < 2 {
				t.Fatalf("%s: %d alerts fire, %d of them %s: want the cause once and symptoms", s.name, len(s.firing), causes, s.cause)
			}
			t.Logf("%s: %d alerts fire, %d critical", s.cause, len(s.firing), criticals)

			addr := freeAddr(t)
			serverProc(t, "alertmanager", nil, syscall.SIGTERM, nil, bin, "--config.file="+config,
				"--storage.path="+t.TempDir(), "--web.listen-address="+addr, "--cluster.listen-address=")
			base := "http://" + addr + "/api/v2"
			var post []map[string]any
			for _, labels := range s.firing {
				post = append(post, map[string]any{"labels": labels})
			}
			body, err := json.Marshal(post)
			if err != nil {
				t.Fatal(err)
			}
			// Alertmanager's inhibitor learns of a source alert on its own
			// schedule, after the alert is listed: the state is read until it
			// settles as wanted, and the last one is reported.
			deadline := time.Now().Add(time.Minute)
			for {
				got, err := postAndReadAlerts(base, body)
				var wrong []string
				if err == nil && len(got) == len(s.firing) {
					for _, a := range got {
						name := a.Labels["alertname"]
						inhibited := len(a.Status.InhibitedBy) > 0
						if name == s.cause && inhibited {
							wrong = append(wrong, fmt.Sprintf("the cause %s %v is inhibited by %v", name, a.Labels, a.Status.InhibitedBy))
						}
						if name != s.cause && !inhibited {
							wrong = append(wrong, fmt.Sprintf("%s %v (severity %s) is not inhibited: %s is its cause", name, a.Labels, a.Labels["severity"], s.cause))
						}
					}
					if len(wrong) == 0 {
						return
					}
				}
				if time.Now().After(deadline) {
					if len(wrong) > 0 {
						t.Fatalf("after a minute:\n%s", strings.Join(wrong, "\n"))
					}
					t.Fatalf("Alertmanager never held the %d alerts: %d, error %v", len(s.firing), len(got), err)
				}
				time.Sleep(200 * time.Millisecond)
			}
		})
	}
}

type amAlert struct {
	Labels map[string]string `json:"labels"`
	Status struct {
		State       string   `json:"state"`
		InhibitedBy []string `json:"inhibitedBy"`
	} `json:"status"`
}

// postAndReadAlerts sends the alerts of body to Alertmanager and returns
// the alerts it holds.
func postAndReadAlerts(base string, body []byte) ([]amAlert, error) {
	resp, err := http.Post(base+"/alerts", "application/json", strings.NewReader(string(body)))
	if err != nil {
		return nil, err
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("POST /alerts: %s", resp.Status)
	}
	resp, err = http.Get(base + "/alerts")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var got []amAlert
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		return nil, err
	}
	return got, nil
}

// The runbook's table of inhibitions (docs/operations.md, "Alert routing")
// is alertmanager.yml's inhibit_rules: one row per source alert, naming
// every alert it inhibits and the jobs a target is limited to, and saying
// "of the same node" where the rule wants the instance equal; no row for a
// cause the configuration does not have.
func TestRunbookListsTheInhibitions(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(alertmanagerConfig)
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		InhibitRules []struct {
			SourceMatchers []string `yaml:"source_matchers"`
			TargetMatchers []string `yaml:"target_matchers"`
			Equal          []string `yaml:"equal"`
		} `yaml:"inhibit_rules"`
	}
	if err := yaml.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	type inhibits struct {
		alerts, jobs map[string]bool
		sameNode     bool
	}
	matcher := regexp.MustCompile(`^(\w+)(=~|=)"([^"]*)"$`)
	values := func(m string) (string, []string) {
		sm := matcher.FindStringSubmatch(m)
		if sm == nil {
			t.Fatalf("%s: matcher %q: want label=\"value\" or label=~\"a|b\"", alertmanagerConfig, m)
		}
		return sm[1], strings.Split(sm[3], "|")
	}
	want := map[string]*inhibits{}
	for _, r := range cfg.InhibitRules {
		if len(r.SourceMatchers) != 1 {
			t.Fatalf("%s: source_matchers %v: want one alertname", alertmanagerConfig, r.SourceMatchers)
		}
		label, src := values(r.SourceMatchers[0])
		if label != "alertname" || len(src) != 1 {
			t.Fatalf("%s: source_matchers %v: want one alertname", alertmanagerConfig, r.SourceMatchers)
		}
		in := want[src[0]]
		if in == nil {
			in = &inhibits{alerts: map[string]bool{}, jobs: map[string]bool{}}
			want[src[0]] = in
		}
		named := false
		for _, m := range r.TargetMatchers {
			switch label, vs := values(m); label {
			case "alertname":
				named = true
				for _, v := range vs {
					in.alerts[v] = true
				}
			case "job":
				for _, v := range vs {
					in.jobs[v] = true
				}
			default:
				t.Fatalf("%s: target matcher %q: the table says alert names and jobs only", alertmanagerConfig, m)
			}
		}
		if !named {
			t.Fatalf("%s: target_matchers %v name no alert", alertmanagerConfig, r.TargetMatchers)
		}
		switch {
		case slices.Equal(r.Equal, []string{"instance"}):
			in.sameNode = true
		case len(r.Equal) > 0:
			t.Fatalf("%s: equal %v: the table says \"of the same node\" for [instance] only", alertmanagerConfig, r.Equal)
		}
	}
	if len(want) == 0 {
		t.Fatalf("%s has no inhibit_rules", alertmanagerConfig)
	}

	doc, err := os.ReadFile(runbook)
	if err != nil {
		t.Fatal(err)
	}
	cause := regexp.MustCompile(`^\[(\w+)\]\(#`)
	alertName := regexp.MustCompile(`\b[A-Z][A-Za-z]+\b`)
	job := regexp.MustCompile("`([a-z-]+)`")
	rows, inTable := 0, false
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(line, "| cause (critical) | inhibits |") {
			inTable = true
			continue
		}
		if !inTable || strings.HasPrefix(line, "| ---") {
			continue
		}
		if !strings.HasPrefix(line, "|") {
			break
		}
		rows++
		cells := strings.Split(strings.Trim(line, "| "), " | ")
		c := cause.FindStringSubmatch(cells[0])
		if c == nil || len(cells) != 2 {
			t.Errorf("%s: row %q: want [Cause](#cause) | what it inhibits", runbook, line)
			continue
		}
		w, ok := want[c[1]]
		delete(want, c[1])
		if !ok {
			t.Errorf("%s: %s inhibits nothing in %s", runbook, c[1], alertmanagerConfig)
			continue
		}
		got := inhibits{alerts: map[string]bool{}, jobs: map[string]bool{}, sameNode: strings.Contains(cells[1], "of the same node")}
		for _, a := range alertName.FindAllString(cells[1], -1) {
			got.alerts[a] = true
		}
		for _, j := range job.FindAllStringSubmatch(cells[1], -1) {
			got.jobs[j[1]] = true
		}
		if !maps.Equal(got.alerts, w.alerts) {
			t.Errorf("%s: %s inhibits %v, %s says %v", runbook, c[1], slices.Sorted(maps.Keys(got.alerts)), alertmanagerConfig, slices.Sorted(maps.Keys(w.alerts)))
		}
		if !maps.Equal(got.jobs, w.jobs) {
			t.Errorf("%s: %s names the jobs %v, %s %v", runbook, c[1], slices.Sorted(maps.Keys(got.jobs)), alertmanagerConfig, slices.Sorted(maps.Keys(w.jobs)))
		}
		if got.sameNode != w.sameNode {
			t.Errorf("%s: %s says \"of the same node\": %v, %s wants the instance equal: %v", runbook, c[1], got.sameNode, alertmanagerConfig, w.sameNode)
		}
	}
	if rows == 0 {
		t.Fatalf("%s has no table of inhibitions (| cause (critical) | inhibits |)", runbook)
	}
	for c := range want {
		t.Errorf("%s: %s inhibits alerts in %s but has no row", runbook, c, alertmanagerConfig)
	}
}

package deploy_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
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

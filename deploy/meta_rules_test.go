package deploy_test

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

const metaRules = "prometheus/rules/meta.yml"

// The meta-monitoring alerts (rules/meta.yml) read only metrics the real
// Prometheus and Alertmanager export (Debian packages prometheus and
// prometheus-alertmanager): both are started, Prometheus loading the rules,
// sending to that Alertmanager and scraping both, and their /metrics read.
// Their unit tests run with the others (TestAlertRuleUnitTests, and the
// checks of every rule set).
func TestMetaAlertsReadMetricsPrometheusAndAlertmanagerExport(t *testing.T) {
	t.Parallel()
	promBin, err := exec.LookPath("prometheus")
	if err != nil {
		skipOrFail(t, "prometheus not found: install the Debian package prometheus")
	}
	amBin, err := exec.LookPath("prometheus-alertmanager")
	if err != nil {
		skipOrFail(t, "alertmanager not found: install the Debian package prometheus-alertmanager")
	}
	amConfig, err := filepath.Abs(alertmanagerConfig)
	if err != nil {
		t.Fatal(err)
	}
	rules, err := filepath.Abs(metaRules)
	if err != nil {
		t.Fatal(err)
	}
	amAddr, promAddr := freeAddr(t), freeAddr(t)
	serverProc(t, "alertmanager", nil, syscall.SIGTERM, nil, amBin, "--config.file="+amConfig,
		"--storage.path="+t.TempDir(), "--web.listen-address="+amAddr, "--cluster.listen-address=")
	dir := t.TempDir()
	config := fmt.Sprintf(`global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: [%q]
alerting:
  alertmanagers: [{static_configs: [{targets: [%q]}]}]
scrape_configs:
  - {job_name: prometheus, static_configs: [{targets: [%q]}]}
  - {job_name: alertmanager, static_configs: [{targets: [%q]}]}
`, rules, amAddr, promAddr, amAddr)
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	serverProc(t, "prometheus", nil, syscall.SIGTERM, nil, promBin, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+promAddr)

	var names []string
	for _, r := range readRules(t, metaRules) {
		ns, err := metricNames(r.Expr)
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, ns...)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		exposed := scrapeText(t, "http://"+promAddr+"/metrics") + scrapeText(t, "http://"+amAddr+"/metrics")
		var missing []string
		for _, n := range names {
			if n != "up" && !strings.Contains(exposed, "\n"+n+"{") && !strings.Contains(exposed, "\n"+n+" ") {
				missing = append(missing, n)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s reads %v, which neither Prometheus nor Alertmanager exports", metaRules, missing)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// scrapeText returns a /metrics page, or "" while it cannot be read.
func scrapeText(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return ""
	}
	return "\n" + string(b)
}

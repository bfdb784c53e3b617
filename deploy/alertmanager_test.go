package deploy_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const alertmanagerConfig = "alertmanager/alertmanager.yml"

// amtool returns the path of amtool (Debian package prometheus-alertmanager,
// which .ci/run installs): the test skips without it, and fails under
// CI=true.
func amtool(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("amtool"); err == nil {
		return p
	}
	skipOrFail(t, "amtool not found: install the Debian package prometheus-alertmanager")
	return ""
}

// receiverFor returns the receiver Alertmanager's routing tree in config
// picks for an alert with these labels (`amtool config routes test`).
func receiverFor(t *testing.T, config string, labels ...string) string {
	t.Helper()
	out, err := exec.Command(amtool(t), append([]string{"config", "routes", "test", "--config.file=" + config}, labels...)...).Output()
	if err != nil {
		t.Fatalf("amtool config routes test %v: %v\n%s", labels, err, out)
	}
	return strings.TrimSpace(string(out))
}

// The compose Alertmanager runs this repository's configuration, which
// amtool accepts, and every alert of the rules reaches the receiver of its
// severity: critical pages (oncall), warning and info go to the team, and
// Watchdog to its dead man's switch (the alerts of every rule file).
func TestComposeAlertmanagerRoutesBySeverity(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	am := service(t, p, "alertmanager")
	mounts := bindMounts(t, am)
	configPath := flagValue(am.Command, "--config.file")
	if h := hostPath(mounts, configPath); !sameFile(t, h, alertmanagerConfig) {
		t.Fatalf("alertmanager reads %q, mounted from %q, want deploy/%s", configPath, h, alertmanagerConfig)
	}
	if !exposes(am, "9093") {
		t.Errorf("alertmanager does not publish 9093, where Prometheus sends its alerts")
	}

	if out, err := exec.Command(amtool(t), "check-config", alertmanagerConfig).CombinedOutput(); err != nil {
		t.Fatalf("amtool check-config: %v\n%s", err, out)
	}
	// amtool must reject what it is given to reject.
	raw, err := os.ReadFile(alertmanagerConfig)
	if err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(t.TempDir(), "bad.yml")
	if err := os.WriteFile(bad, []byte(strings.Replace(string(raw), "receiver: oncall", "receiver: nobody", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(amtool(t), "check-config", bad).CombinedOutput(); err == nil {
		t.Fatalf("amtool check-config accepted a route to an undefined receiver:\n%s", out)
	}

	want := map[string]string{"critical": "oncall", "warning": "team", "info": "team", "none": "watchdog"}
	files, err := filepath.Glob(filepath.Join(promDir, "rules", "*.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var rules []rule
	for _, f := range files {
		rules = append(rules, readRules(t, f)...)
	}
	for _, r := range rules {
		if r.Alert == "" {
			continue
		}
		sev := r.Labels["severity"]
		if got := receiverFor(t, alertmanagerConfig, "alertname="+r.Alert, "severity="+sev); got != want[sev] {
			t.Errorf("alert %s (severity %s) goes to receiver %q, want %q", r.Alert, sev, got, want[sev])
		}
	}
}

// postgres-exporter reaches the compose PostgreSQL with the credentials the
// postgres service was given, and runs the queries of
// deploy/postgres-exporter/queries.yaml (tested against a real server by
// TestPostgresExporterSeesReplicationSlots).
func TestComposePostgresExporter(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	ex := service(t, p, "postgres-exporter")
	pg := service(t, p, "postgres")
	dsn, err := url.Parse(env(t, ex, "DATA_SOURCE_NAME"))
	if err != nil {
		t.Fatalf("postgres-exporter DATA_SOURCE_NAME: %v", err)
	}
	host, port := hostPort(t, dsn, "5432")
	pass, _ := dsn.User.Password()
	if host != "postgres" || !exposes(pg, port) || dsn.User.Username() != env(t, pg, "POSTGRES_USER") || pass != env(t, pg, "POSTGRES_PASSWORD") {
		t.Errorf("postgres-exporter DATA_SOURCE_NAME %s: want the postgres service with its POSTGRES_USER and POSTGRES_PASSWORD", dsn.Redacted())
	}
	if got, want := strings.TrimPrefix(dsn.Path, "/"), env(t, pg, "POSTGRES_DB"); got != want {
		t.Errorf("postgres-exporter connects to database %q, the orders database is %q", got, want)
	}
	queries := env(t, ex, "PG_EXPORTER_EXTEND_QUERY_PATH")
	if h := hostPath(bindMounts(t, ex), queries); !sameFile(t, h, exporterQueries) {
		t.Errorf("postgres-exporter reads its queries from %s, mounted from %q, want deploy/%s", queries, h, exporterQueries)
	}
	// From 0.20 on the exporter's own replication_slots collector exports
	// pg_replication_slots_active and _safe_wal_size_bytes with other
	// labels than the query file's: the file goes with that upgrade
	// (docs/operations.md, "Replication slot alerts").
	m := regexp.MustCompile(`:v(\d+)\.(\d+)\.\d+$`).FindStringSubmatch(ex.Image)
	if m == nil {
		t.Fatalf("postgres-exporter image %q: want a version tag vX.Y.Z", ex.Image)
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	if major > 0 || minor >= 20 {
		t.Errorf("postgres-exporter %s reads the query file %s, two of whose series its replication_slots collector exports under the same names from 0.20: move the rules to the collector and drop the file", ex.Image, exporterQueries)
	}
}

// The real Alertmanager (Debian package prometheus-alertmanager), run with
// the compose configuration, files a critical alert under oncall, a warning
// under team and Watchdog under watchdog, as Prometheus would send them.
func TestAlertmanagerFilesAlertsByReceiver(t *testing.T) {
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
	addr := freeAddr(t)
	serverProc(t, "alertmanager", nil, syscall.SIGTERM, nil, bin, "--config.file="+config,
		"--storage.path="+t.TempDir(), "--web.listen-address="+addr, "--cluster.listen-address=")
	base := "http://" + addr + "/api/v2"

	alerts := `[
		{"labels": {"alertname": "OutboxStalled", "severity": "critical"}},
		{"labels": {"alertname": "OutboxDeadLetters", "severity": "warning"}},
		{"labels": {"alertname": "Watchdog", "severity": "none"}}
	]`
	want := map[string]string{"OutboxStalled": "oncall", "OutboxDeadLetters": "team", "Watchdog": "watchdog"}
	deadline := time.Now().Add(time.Minute)
	var last string
	for {
		got := map[string]string{}
		resp, err := http.Post(base+"/alerts", "application/json", strings.NewReader(alerts))
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				got, err = alertGroups(base)
			} else {
				err = fmt.Errorf("POST /alerts: %s", resp.Status)
			}
		}
		if err == nil && maps.Equal(got, want) {
			return
		}
		last = fmt.Sprintf("receivers %v, error %v", got, err)
		if time.Now().After(deadline) {
			t.Fatalf("Alertmanager never filed the alerts as %v: %s", want, last)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// alertGroups returns, per alert name, the receiver of its group.
func alertGroups(base string) (map[string]string, error) {
	resp, err := http.Get(base + "/alerts/groups")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var groups []struct {
		Receiver struct {
			Name string `json:"name"`
		} `json:"receiver"`
		Alerts []struct {
			Labels map[string]string `json:"labels"`
		} `json:"alerts"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&groups); err != nil {
		return nil, err
	}
	got := map[string]string{}
	for _, g := range groups {
		for _, a := range g.Alerts {
			got[a.Labels["alertname"]] = g.Receiver.Name
		}
	}
	return got, nil
}

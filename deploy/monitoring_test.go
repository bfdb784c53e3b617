package deploy_test

import (
	"cmp"
	"encoding/json"
	"maps"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"
	"go.yaml.in/yaml/v3"
)

// bindMounts returns a service's bind mounts, container path -> host path,
// after checking each host path exists and is mounted read-only.
func bindMounts(t *testing.T, s types.ServiceConfig) map[string]string {
	t.Helper()
	mounts := map[string]string{}
	for _, v := range s.Volumes {
		if v.Type != types.VolumeTypeBind {
			continue
		}
		if _, err := os.Stat(v.Source); err != nil {
			t.Errorf("%s mounts %s, which does not exist: %v", s.Name, v.Source, err)
		}
		if !v.ReadOnly {
			t.Errorf("%s mounts %s read-write; want :ro", s.Name, v.Source)
		}
		mounts[v.Target] = v.Source
	}
	return mounts
}

// hostPath returns the host file behind a container path, through mounts
// (a mounted file, or a file under a mounted directory), or "".
func hostPath(mounts map[string]string, p string) string {
	for target, source := range mounts {
		if p == target {
			return source
		}
		if rel, ok := strings.CutPrefix(p, target+"/"); ok {
			return filepath.Join(source, filepath.FromSlash(rel))
		}
	}
	return ""
}

// sameFile reports whether two host paths name the same file.
func sameFile(t *testing.T, a, b string) bool {
	t.Helper()
	sa, errA := os.Stat(a)
	sb, errB := os.Stat(b)
	return errA == nil && errB == nil && os.SameFile(sa, sb)
}

// flagValue returns the value of a --name=value argument of a service's
// command, or "".
func flagValue(command types.ShellCommand, name string) string {
	var v string
	for _, arg := range command {
		if rest, ok := strings.CutPrefix(arg, name+"="); ok {
			v = rest
		}
	}
	return v
}

// httpAddrPort returns the port a service's HTTP_ADDR listens on.
func httpAddrPort(t *testing.T, s types.ServiceConfig) string {
	t.Helper()
	_, port, err := net.SplitHostPort(env(t, s, "HTTP_ADDR"))
	if err != nil {
		t.Fatalf("%s HTTP_ADDR: %v", s.Name, err)
	}
	return port
}

type promConfigFile struct {
	RuleFiles []string `yaml:"rule_files"`
	Alerting  struct {
		Alertmanagers []struct {
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"alertmanagers"`
	} `yaml:"alerting"`
	ScrapeConfigs []struct {
		JobName      string              `yaml:"job_name"`
		MetricsPath  string              `yaml:"metrics_path"`
		Params       map[string][]string `yaml:"params"`
		DNSSDConfigs []struct {
			Names []string `yaml:"names"`
			Type  string   `yaml:"type"`
			Port  int      `yaml:"port"`
		} `yaml:"dns_sd_configs"`
		StaticConfigs []struct {
			Targets []string `yaml:"targets"`
		} `yaml:"static_configs"`
	} `yaml:"scrape_configs"`
}

// scrapeJob is what Prometheus must scrape: the compose services behind a
// job, on which port and path (with its query).
type scrapeJob struct {
	services []string
	port     string
	path     string
}

// rabbitQueueFamilies are the per-queue metric families of
// rabbitmq_prometheus the rules read (rabbitmq_detailed_queue_messages*,
// rabbitmq_detailed_queue_consumers, rabbitmq_detailed_channel_messages_acked_total);
// its aggregated /metrics has no queue label, and its /metrics/per-object
// no resource alarms.
const rabbitQueueFamilies = "/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count&family=channel_queue_metrics"

// scrapeJobs are the jobs the rules and the dashboard read, by job name.
// The applications' ports are those their HTTP_ADDR listens on.
func scrapeJobs(t *testing.T, p *types.Project) map[string]scrapeJob {
	t.Helper()
	jobs := map[string]scrapeJob{
		// The exporter's and the plugin's default ports.
		"postgres-exporter": {[]string{"postgres-exporter"}, "9187", "/metrics"},
		"rabbitmq":          {[]string{"rabbitmq"}, "15692", "/metrics"},
		"rabbitmq-queues":   {append([]string{"rabbitmq"}, clusterNodes...), "15692", rabbitQueueFamilies},
		"rabbitmq-cluster":  {clusterNodes, "15692", "/metrics"},
		"alertmanager":      {[]string{"alertmanager"}, "9093", "/metrics"},
		// The loss audit's -metrics-addr.
		"audit": {[]string{"audit"}, "9464", "/metrics"},
	}
	for _, name := range apps {
		jobs[name] = scrapeJob{[]string{name}, httpAddrPort(t, service(t, p, name)), "/metrics"}
	}
	return jobs
}

// Prometheus runs with this repository's configuration and rules, scrapes
// every replica of each application service on the port it listens on, the
// database through postgres-exporter and the broker's rabbitmq_prometheus
// plugin (per queue), sends its alerts to the compose Alertmanager, keeps
// exemplars, and keeps its data in a named volume.
func TestComposePrometheusScrapesEveryService(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	withCluster := load(t, nil, "cluster")
	prom := service(t, p, "prometheus")
	mounts := bindMounts(t, prom)

	configPath := flagValue(prom.Command, "--config.file")
	if configPath == "" {
		t.Fatalf("prometheus command %v: want --config.file=...", prom.Command)
	}
	hostConfig := hostPath(mounts, configPath)
	if !sameFile(t, hostConfig, promConfig) {
		t.Fatalf("prometheus reads %s, mounted from %q, want deploy/%s", configPath, hostConfig, promConfig)
	}
	raw, err := os.ReadFile(hostConfig)
	if err != nil {
		t.Fatal(err)
	}
	var cfg promConfigFile
	if err := yaml.Unmarshal(raw, &cfg); err != nil {
		t.Fatalf("%s: %v", promConfig, err)
	}
	if len(cfg.RuleFiles) == 0 {
		t.Errorf("%s loads no rule files", promConfig)
	}
	for _, rf := range cfg.RuleFiles {
		inContainer := rf
		if !path.IsAbs(rf) {
			inContainer = path.Join(path.Dir(configPath), rf)
		}
		if h := hostPath(mounts, inContainer); h == "" {
			t.Errorf("rule file %s (%s in the container) is not mounted", rf, inContainer)
		} else if !sameFile(t, h, filepath.Join(promDir, filepath.FromSlash(rf))) {
			t.Errorf("rule file %s is mounted from %s, not from deploy/%s/%s", rf, h, promDir, rf)
		}
	}

	want := scrapeJobs(t, p)
	seen := map[string]bool{}
	for _, sc := range cfg.ScrapeConfigs {
		path := cmp.Or(sc.MetricsPath, "/metrics")
		if len(sc.Params) > 0 {
			path += "?" + url.Values(sc.Params).Encode()
		}
		job, expected := want[sc.JobName]
		seen[sc.JobName] = expected
		var names []string
		for _, sd := range sc.DNSSDConfigs {
			if sd.Type != "A" {
				t.Errorf("job %s: dns_sd type %q, want A (every replica's address)", sc.JobName, sd.Type)
			}
			for _, name := range sd.Names {
				if _, ok := withCluster.Services[name]; !ok {
					t.Errorf("job %s scrapes %s, which is not a compose service", sc.JobName, name)
				}
				names = append(names, name)
				if expected && strconv.Itoa(sd.Port) != job.port {
					t.Errorf("job %s scrapes %s on port %d, want %s", sc.JobName, name, sd.Port, job.port)
				}
			}
		}
		if expected {
			slices.Sort(names)
			if !slices.Equal(names, job.services) {
				t.Errorf("job %s scrapes %v, want %v: the rules expect these job names", sc.JobName, names, job.services)
			}
			if path != job.path {
				t.Errorf("job %s scrapes %s, want %s", sc.JobName, path, job.path)
			}
		}
		for _, st := range sc.StaticConfigs {
			for _, target := range st.Targets {
				host, _, err := net.SplitHostPort(target)
				if err != nil {
					t.Errorf("job %s: target %q: %v", sc.JobName, target, err)
				}
				if _, ok := p.Services[host]; ok {
					t.Errorf("job %s names %s statically: use dns_sd_configs so every replica is scraped", sc.JobName, host)
				}
			}
		}
	}
	for job := range want {
		if !seen[job] {
			t.Errorf("prometheus has no job %s", job)
		}
	}
	var am []string
	for _, a := range cfg.Alerting.Alertmanagers {
		for _, st := range a.StaticConfigs {
			am = append(am, st.Targets...)
		}
	}
	if !slices.Equal(am, []string{"alertmanager:9093"}) {
		t.Errorf("prometheus sends its alerts to %v, want the compose alertmanager:9093", am)
	}
	if !slices.Contains(prom.Command, "--enable-feature=exemplar-storage") {
		t.Errorf("prometheus command %v: want --enable-feature=exemplar-storage, or the dashboard has no exemplars to link to traces", prom.Command)
	}
	ok := slices.ContainsFunc(prom.Volumes, func(v types.ServiceVolumeConfig) bool {
		_, declared := p.Volumes[v.Source]
		return v.Type == types.VolumeTypeVolume && v.Target == "/prometheus" && declared
	})
	if !ok {
		t.Errorf("prometheus: want a declared named volume on /prometheus, so history survives a restart")
	}
}

type grafanaDatasources struct {
	Datasources []struct {
		Name     string `yaml:"name"`
		UID      string `yaml:"uid"`
		Type     string `yaml:"type"`
		URL      string `yaml:"url"`
		JSONData struct {
			ExemplarTraceIDDestinations []struct {
				Name          string `yaml:"name"`
				DatasourceUID string `yaml:"datasourceUid"`
			} `yaml:"exemplarTraceIdDestinations"`
		} `yaml:"jsonData"`
	} `yaml:"datasources"`
}

type grafanaProviders struct {
	Providers []struct {
		Name    string `yaml:"name"`
		Type    string `yaml:"type"`
		Options struct {
			Path string `yaml:"path"`
		} `yaml:"options"`
	} `yaml:"providers"`
}

// provisioningFiles returns the YAML files Grafana reads from a mounted
// provisioning directory.
func provisioningFiles(t *testing.T, mounts map[string]string, dir string) []string {
	t.Helper()
	host := hostPath(mounts, dir)
	if host == "" {
		t.Fatalf("grafana: nothing is mounted on %s", dir)
	}
	var files []string
	for _, pattern := range []string{"*.yml", "*.yaml"} {
		m, err := filepath.Glob(filepath.Join(host, pattern))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	if len(files) == 0 {
		t.Fatalf("grafana: %s (from %s) holds no provisioning file", dir, host)
	}
	return files
}

// Grafana is provisioned with a datasource that is the compose Prometheus,
// whose exemplars link to the trace in a Jaeger datasource that is the
// compose Jaeger, and with the dashboards of deploy/grafana/dashboards,
// whose panels all use a Prometheus datasource (through the dashboard's
// datasource variable); its home dashboard exists.
func TestComposeGrafanaIsProvisioned(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	g := service(t, p, "grafana")
	mounts := bindMounts(t, g)

	// The compose service each datasource type must point at, on this port.
	backends := map[string][2]string{"prometheus": {"prometheus", "9090"}, "jaeger": {"jaeger", "16686"}}
	uids := map[string]string{} // uid -> type
	exemplarsTo := map[string]string{}
	for _, f := range provisioningFiles(t, mounts, "/etc/grafana/provisioning/datasources") {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var ds grafanaDatasources
		if err := yaml.Unmarshal(raw, &ds); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, d := range ds.Datasources {
			u, err := url.Parse(d.URL)
			backend, known := backends[d.Type]
			if err != nil || !known || d.UID == "" {
				t.Errorf("%s: datasource %q: want type prometheus or jaeger, a uid and a URL, got %+v", f, d.Name, d)
				continue
			}
			svc, ok := p.Services[u.Hostname()]
			if !ok || u.Hostname() != backend[0] || u.Port() != backend[1] || !exposes(svc, u.Port()) {
				t.Errorf("%s: datasource %q points at %s, want the compose %s service on port %s", f, d.Name, d.URL, backend[0], backend[1])
			}
			uids[d.UID] = d.Type
			for _, e := range d.JSONData.ExemplarTraceIDDestinations {
				exemplarsTo[d.UID] = e.DatasourceUID
				if e.Name != "trace_id" {
					t.Errorf("%s: datasource %q reads exemplar label %q; shipping's exemplars carry trace_id", f, d.Name, e.Name)
				}
			}
		}
	}
	var promUID string
	for uid, typ := range uids {
		if typ == "prometheus" {
			promUID = uid
		}
	}
	if promUID == "" {
		t.Fatal("grafana: no Prometheus datasource is provisioned")
	}
	if to := exemplarsTo[promUID]; uids[to] != "jaeger" {
		t.Errorf("grafana: the Prometheus datasource's exemplars link to %q, want the Jaeger datasource", to)
	}

	var dashboards []string
	for _, f := range provisioningFiles(t, mounts, "/etc/grafana/provisioning/dashboards") {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var pr grafanaProviders
		if err := yaml.Unmarshal(raw, &pr); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, prov := range pr.Providers {
			host := hostPath(mounts, prov.Options.Path)
			if prov.Type != "file" || host == "" {
				t.Errorf("%s: provider %q reads %q, which is not mounted", f, prov.Name, prov.Options.Path)
				continue
			}
			m, err := filepath.Glob(filepath.Join(host, "*.json"))
			if err != nil {
				t.Fatal(err)
			}
			dashboards = append(dashboards, m...)
		}
	}
	if len(dashboards) == 0 {
		t.Fatal("grafana: the provisioned dashboard folders hold no dashboard")
	}
	for _, f := range dashboards {
		d := readDashboard(t, f)
		// A datasource variable stands for every provisioned datasource of
		// its type.
		vars := map[string]string{}
		for _, v := range d.Templating.List {
			if v.Type == "datasource" {
				vars["${"+v.Name+"}"], vars["$"+v.Name] = v.Query, v.Query
			}
		}
		for _, pnl := range d.panels() {
			for _, uid := range pnl.datasourceUIDs() {
				typ, isVar := vars[uid]
				if !isVar {
					typ = uids[uid]
				}
				if typ != "prometheus" {
					t.Errorf("%s: panel %q uses datasource %q, which is no provisioned Prometheus datasource nor a variable of that type (have %v)", f, pnl.Title, uid, keys(uids))
				}
			}
		}
	}

	home := env(t, g, "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
	if h := hostPath(mounts, home); h == "" || !slices.ContainsFunc(dashboards, func(d string) bool { return sameFile(t, d, h) }) {
		t.Errorf("grafana home dashboard %s is not one of the provisioned dashboards", home)
	}
}

// dashboard is the part of a Grafana dashboard JSON the tests read.
type dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query string `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	Targets    []struct {
		RefID      string          `json:"refId"`
		Expr       string          `json:"expr"`
		Exemplar   bool            `json:"exemplar"`
		Datasource json.RawMessage `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's panels
}

func readDashboard(t *testing.T, path string) dashboard {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return d
}

// panels returns every panel, those inside collapsed rows included, rows
// excluded.
func (d dashboard) panels() []panel {
	var out []panel
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			if p.Type != "row" {
				out = append(out, p)
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// datasourceUIDs returns the datasource uids a panel and its queries name.
func (p panel) datasourceUIDs() []string {
	var uids []string
	add := func(raw json.RawMessage) {
		var ref struct {
			UID string `json:"uid"`
		}
		if len(raw) > 0 && json.Unmarshal(raw, &ref) == nil && ref.UID != "" {
			uids = append(uids, ref.UID)
		}
	}
	add(p.Datasource)
	for _, q := range p.Targets {
		add(q.Datasource)
	}
	slices.Sort(uids)
	return slices.Compact(uids)
}

// The dashboard lets the viewer pick the Prometheus datasource (every panel
// uses the variable), shows the commit-to-applied SLI with its exemplars
// (each links to its trace through the datasource's exemplar destination),
// the broker's queues and the database's replication slots.
func TestDashboardShowsTheSLOTheBrokerAndTheSlots(t *testing.T) {
	t.Parallel()
	d := readDashboard(t, "grafana/dashboards/outbox-inbox.json")
	variable := ""
	for _, v := range d.Templating.List {
		if v.Type == "datasource" && v.Query == "prometheus" {
			variable = "${" + v.Name + "}"
		}
	}
	if variable == "" {
		t.Fatal("the dashboard has no Prometheus datasource variable")
	}
	want := map[string]bool{ // a metric some panel must show -> with exemplars
		"shipping_commit_to_applied_seconds_bucket": true,
		"rabbitmq_detailed_queue_messages_ready":    false,
		"rabbitmq_detailed_queue_consumers":         false,
		"pg_replication_slots_retained_bytes":       false,
		"pg_replication_slots_wal_at_risk":          false,
	}
	shown := map[string]bool{}
	for _, p := range d.panels() {
		for _, uid := range p.datasourceUIDs() {
			if uid != variable {
				t.Errorf("panel %q uses datasource %q, not the variable %s", p.Title, uid, variable)
			}
		}
		for _, q := range p.Targets {
			for metric, exemplars := range want {
				if strings.Contains(q.Expr, metric) && (!exemplars || q.Exemplar) {
					shown[metric] = true
				}
			}
		}
	}
	for metric, exemplars := range want {
		if !shown[metric] {
			t.Errorf("no panel shows %s (with exemplars: %v)", metric, exemplars)
		}
	}
}

// The runbook's table of scrape jobs (docs/operations.md, "Running it") is
// prometheus.yml's: every job has a row naming it, with its port and its
// path (and query), and no row names a job prometheus.yml does not have.
func TestRunbookListsTheScrapeJobs(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(promConfig)
	if err != nil {
		t.Fatal(err)
	}
	var cfg promConfigFile
	if err := yaml.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(runbook)
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{} // job -> its row's last cell
	inTable := false
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(line, "| job | what | port, path |") {
			inTable = true
			continue
		}
		if !inTable || strings.HasPrefix(line, "| ---") {
			continue
		}
		if !strings.HasPrefix(line, "|") {
			if len(rows) > 0 {
				break
			}
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), " | ")
		for _, m := range regexp.MustCompile("`([a-z-]+)`").FindAllStringSubmatch(cells[0], -1) {
			rows[m[1]] = cells[len(cells)-1]
		}
	}
	if len(rows) == 0 {
		t.Fatalf("%s has no table of scrape jobs (| job | what | port, path |)", runbook)
	}
	for _, sc := range cfg.ScrapeConfigs {
		cell, ok := rows[sc.JobName]
		delete(rows, sc.JobName)
		if !ok {
			t.Errorf("%s: job %s has no row", runbook, sc.JobName)
			continue
		}
		path := cmp.Or(sc.MetricsPath, "/metrics")
		if len(sc.Params) > 0 {
			var q []string
			for _, k := range slices.Sorted(maps.Keys(sc.Params)) {
				for _, v := range sc.Params[k] {
					q = append(q, k+"="+v)
				}
			}
			path += "?" + strings.Join(q, "&")
		}
		var ports []string
		for _, sd := range sc.DNSSDConfigs {
			ports = append(ports, strconv.Itoa(sd.Port))
		}
		for _, st := range sc.StaticConfigs {
			for _, target := range st.Targets {
				if _, p, err := net.SplitHostPort(target); err == nil {
					ports = append(ports, p)
				}
			}
		}
		if !strings.Contains(cell, "`"+path+"`") {
			t.Errorf("%s: job %s's row says %q, want its path `%s`", runbook, sc.JobName, cell, path)
		}
		for _, p := range ports {
			if !strings.Contains(cell, p) {
				t.Errorf("%s: job %s's row says %q, want its port %s", runbook, sc.JobName, cell, p)
			}
		}
	}
	for job := range rows {
		t.Errorf("%s lists a job %s that prometheus.yml does not scrape", runbook, job)
	}
}

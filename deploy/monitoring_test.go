package deploy_test

import (
	"encoding/json"
	"net"
	"net/url"
	"os"
	"path"
	"path/filepath"
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
	RuleFiles     []string `yaml:"rule_files"`
	ScrapeConfigs []struct {
		JobName      string `yaml:"job_name"`
		MetricsPath  string `yaml:"metrics_path"`
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

// Prometheus runs with this repository's configuration and rules, scrapes
// every replica of each application service on the port it listens on, and
// keeps its data in a named volume.
func TestComposePrometheusScrapesEveryService(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	prom := service(t, p, "prometheus")
	mounts := bindMounts(t, prom)

	var configPath string
	for _, arg := range prom.Command {
		if v, ok := strings.CutPrefix(arg, "--config.file="); ok {
			configPath = v
		}
	}
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

	scraped := map[string]string{} // service -> port
	for _, sc := range cfg.ScrapeConfigs {
		if sc.MetricsPath != "" && sc.MetricsPath != "/metrics" {
			t.Errorf("job %s scrapes %s: the services serve /metrics", sc.JobName, sc.MetricsPath)
		}
		for _, sd := range sc.DNSSDConfigs {
			if sd.Type != "A" {
				t.Errorf("job %s: dns_sd type %q, want A (every replica's address)", sc.JobName, sd.Type)
			}
			for _, name := range sd.Names {
				if _, ok := p.Services[name]; !ok {
					t.Errorf("job %s scrapes %s, which is not a compose service", sc.JobName, name)
				}
				if sc.JobName != name {
					t.Errorf("job %s scrapes service %s: the rules expect job names equal to the services", sc.JobName, name)
				}
				scraped[name] = strconv.Itoa(sd.Port)
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
	for _, name := range apps {
		port, ok := scraped[name]
		if !ok {
			t.Errorf("prometheus does not scrape %s", name)
			continue
		}
		if want := httpAddrPort(t, service(t, p, name)); port != want {
			t.Errorf("prometheus scrapes %s on port %s, but it listens on %s", name, port, want)
		}
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
		Name string `yaml:"name"`
		UID  string `yaml:"uid"`
		Type string `yaml:"type"`
		URL  string `yaml:"url"`
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

// Grafana is provisioned with a datasource that is the compose Prometheus
// and with the dashboards of deploy/grafana/dashboards, whose panels all use
// that datasource; its home dashboard exists.
func TestComposeGrafanaIsProvisioned(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	g := service(t, p, "grafana")
	mounts := bindMounts(t, g)

	uids := map[string]bool{}
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
			if err != nil || d.Type != "prometheus" || d.UID == "" {
				t.Errorf("%s: datasource %q: want type prometheus, a uid and a URL, got %+v", f, d.Name, d)
				continue
			}
			prom, ok := p.Services[u.Hostname()]
			if !ok || u.Hostname() != "prometheus" || !exposes(prom, u.Port()) {
				t.Errorf("%s: datasource %q points at %s, want the compose prometheus service on a port it publishes", f, d.Name, d.URL)
			}
			uids[d.UID] = true
		}
	}
	if len(uids) == 0 {
		t.Fatal("grafana: no datasource is provisioned")
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
		for _, pnl := range d.panels() {
			for _, uid := range pnl.datasourceUIDs() {
				if !uids[uid] {
					t.Errorf("%s: panel %q uses datasource uid %q, which is not provisioned (have %v)", f, pnl.Title, uid, keys(uids))
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
	UID    string  `json:"uid"`
	Title  string  `json:"title"`
	Panels []panel `json:"panels"`
}

type panel struct {
	ID         int             `json:"id"`
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	Targets    []struct {
		RefID      string          `json:"refId"`
		Expr       string          `json:"expr"`
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

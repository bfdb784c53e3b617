// Package deploy_test checks deploy/docker-compose.yml and deploy/Dockerfile
// on machines without a Docker engine: the compose file is loaded, interpolated
// and validated by compose-go, the library `docker compose config` itself is
// built on, and the loaded model is checked for what the demo depends on.
package deploy_test

import (
	"bufio"
	"context"
	"go/build"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"

	"github.com/outbox-inbox/reference/internal/rabbitnode"
)

const composeFile = "docker-compose.yml"

// load loads the compose file as `docker compose [--profile P] config` does,
// with exactly env as the environment (not the test's own), so defaults are
// what is checked.
func load(t *testing.T, env map[string]string, profiles ...string) *types.Project {
	t.Helper()
	var envList []string
	for k, v := range env {
		envList = append(envList, k+"="+v)
	}
	opts, err := cli.NewProjectOptions([]string{composeFile},
		cli.WithWorkingDirectory("."),
		cli.WithEnv(envList),
		cli.WithProfiles(profiles),
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		t.Fatalf("compose options: %v", err)
	}
	p, err := opts.LoadProject(context.Background())
	if err != nil {
		t.Fatalf("load %s: %v", composeFile, err)
	}
	return p
}

func service(t *testing.T, p *types.Project, name string) types.ServiceConfig {
	t.Helper()
	s, ok := p.Services[name]
	if !ok {
		t.Fatalf("service %q missing; have %v", name, p.ServiceNames())
	}
	return s
}

func env(t *testing.T, s types.ServiceConfig, key string) string {
	t.Helper()
	v, ok := s.Environment[key]
	if !ok || v == nil || *v == "" {
		t.Fatalf("service %s: environment %s is not set", s.Name, key)
	}
	return *v
}

var (
	infra = []string{"mongodb", "postgres", "rabbitmq"}
	apps  = []string{"orders", "relay", "shipping"}
	// oneShot runs to completion before the apps that need it.
	oneShot = []string{"migrate"}
	// monitoring watches the others (monitoring_test.go checks its wiring).
	monitoring = []string{"alertmanager", "audit", "grafana", "postgres-exporter", "prometheus"}
	// tracingBackend receives the services' spans (tracing_test.go checks it).
	tracingBackend = []string{"jaeger"}
)

func TestComposeLoadsWithTheExpectedServices(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	if p.Name != "outbox-inbox" {
		t.Errorf("project name = %q, want outbox-inbox (fixed, so volumes survive a checkout in another folder)", p.Name)
	}
	want := append(append(slices.Clone(infra), apps...), oneShot...)
	want = append(want, monitoring...)
	want = append(want, tracingBackend...)
	slices.Sort(want)
	if got := p.ServiceNames(); !slices.Equal(got, want) {
		t.Fatalf("services without a profile = %v, want %v", got, want)
	}
	if _, ok := p.DisabledServices["loadgen"]; !ok {
		t.Fatalf("loadgen must exist but be off without --profile load; disabled: %v", p.DisabledServices)
	}

	withLoad := load(t, nil, "load")
	lg := service(t, withLoad, "loadgen")
	if !slices.Equal(lg.Profiles, []string{"load"}) {
		t.Errorf("loadgen profiles = %v, want [load]", lg.Profiles)
	}
	cmd := strings.Join(lg.Command, " ")
	for _, want := range []string{"-url=http://orders:8080", "-rate=20", "-duration=10m"} {
		if !strings.Contains(cmd, want) {
			t.Errorf("loadgen command %q lacks %q", cmd, want)
		}
	}
}

// Every long-running service has a healthcheck, and everything that waits on
// another service waits for it to be healthy, not merely started.
func TestHealthchecksAndStartOrder(t *testing.T) {
	t.Parallel()
	p := load(t, nil, "load")
	for name, s := range p.Services {
		if name == "loadgen" || slices.Contains(oneShot, name) {
			continue
		}
		hc := s.HealthCheck
		if hc == nil || hc.Disable || len(hc.Test) < 2 || hc.Test[0] != "CMD" {
			t.Errorf("service %s: want an exec-form healthcheck (CMD ...), got %+v", name, hc)
			continue
		}
		if hc.Interval == nil || hc.Retries == nil || hc.Timeout == nil {
			t.Errorf("service %s: healthcheck needs interval, timeout and retries: %+v", name, hc)
		}
	}

	want := map[string][]string{
		"migrate":  {"postgres"},
		"orders":   {"migrate", "postgres", "rabbitmq"},
		"relay":    {"orders", "rabbitmq"},
		"shipping": {"mongodb", "rabbitmq"},
		"loadgen":  {"orders", "shipping"},
		// The loss audit reads the outbox (its schema made by migrate) and
		// shipping's inbox.
		"audit": {"migrate", "mongodb", "postgres"},
		// Prometheus scrapes whatever is up, from the start, and the
		// exporter connects to the database at each scrape.
		"prometheus":        nil,
		"postgres-exporter": nil,
		"alertmanager":      nil,
		"grafana":           {"prometheus"},
		// Tracing is best effort: nothing waits for its backend.
		"jaeger": nil,
	}
	for name, deps := range want {
		s := service(t, p, name)
		var got []string
		for dep, d := range s.DependsOn {
			got = append(got, dep)
			if slices.Contains(oneShot, dep) {
				if d.Condition != types.ServiceConditionCompletedSuccessfully {
					t.Errorf("%s depends on the one-shot %s with condition %q, want %q", name, dep, d.Condition, types.ServiceConditionCompletedSuccessfully)
				}
				continue
			}
			if d.Condition != types.ServiceConditionHealthy {
				t.Errorf("%s depends on %s with condition %q, want %q", name, dep, d.Condition, types.ServiceConditionHealthy)
			}
			if service(t, p, dep).HealthCheck == nil {
				t.Errorf("%s waits for %s to be healthy, but %s has no healthcheck", name, dep, dep)
			}
		}
		slices.Sort(got)
		if !slices.Equal(got, deps) {
			t.Errorf("%s depends on %v, want %v", name, got, deps)
		}
	}
	for _, name := range infra {
		if len(service(t, p, name).DependsOn) != 0 {
			t.Errorf("%s should depend on nothing", name)
		}
	}
	for _, name := range apps {
		if r := service(t, p, name).Restart; r != types.RestartPolicyUnlessStopped {
			t.Errorf("%s restart = %q, want %q so a crashed process comes back", name, r, types.RestartPolicyUnlessStopped)
		}
	}
	// Only `orders migrate` creates the schema: the orders processes check it
	// read-only at start, so migrate runs once, to completion, before them.
	m := service(t, p, "migrate")
	if !slices.Equal(m.Command, types.ShellCommand{"migrate"}) {
		t.Errorf("migrate command = %v, want [migrate]", m.Command)
	}
	if m.Build == nil || m.Build.Target != service(t, p, "orders").Build.Target {
		t.Errorf("migrate must run the orders binary (build target %q)", service(t, p, "orders").Build.Target)
	}
	if r := m.Restart; r != types.RestartPolicyNo && r != "" {
		t.Errorf("migrate restart = %q, want no: a one-shot that restarts never completes", r)
	}
}

// hostPort returns u's host and port, with def as the default port.
func hostPort(t *testing.T, u *url.URL, def string) (string, string) {
	t.Helper()
	if u.Port() == "" {
		return u.Hostname(), def
	}
	return u.Hostname(), u.Port()
}

// exposes reports whether a service's container listens on port: the port it
// publishes, or the image's well-known port.
func exposes(s types.ServiceConfig, port string) bool {
	for _, pc := range s.Ports {
		if strconv.Itoa(int(pc.Target)) == port {
			return true
		}
	}
	wellKnown := map[string]string{"postgres": "5432", "rabbitmq": "5672", "mongodb": "27017"}
	return wellKnown[s.Name] == port
}

// Every application service gets the variables it reads (the same names as in
// the services and the e2e harness), each pointing at a compose host that
// serves that protocol, with the credentials that host was given.
func TestEnvironmentWiring(t *testing.T) {
	t.Parallel()
	p := load(t, nil, "load")
	pg := service(t, p, "postgres")

	for _, name := range []string{"migrate", "orders", "relay"} {
		s := service(t, p, name)
		db, err := url.Parse(env(t, s, "DATABASE_URL"))
		if err != nil {
			t.Fatalf("%s DATABASE_URL: %v", name, err)
		}
		host, port := hostPort(t, db, "5432")
		if db.Scheme != "postgres" || host != "postgres" || !exposes(pg, port) {
			t.Errorf("%s DATABASE_URL %s: want postgres://...@postgres:5432/...", name, db.Redacted())
		}
		pass, _ := db.User.Password()
		if db.User.Username() != env(t, pg, "POSTGRES_USER") || pass != env(t, pg, "POSTGRES_PASSWORD") {
			t.Errorf("%s DATABASE_URL credentials differ from the postgres service's POSTGRES_USER/POSTGRES_PASSWORD", name)
		}
		if got, want := strings.TrimPrefix(db.Path, "/"), env(t, pg, "POSTGRES_DB"); got != want {
			t.Errorf("%s DATABASE_URL database %q, postgres service creates %q", name, got, want)
		}
		if db.Query().Get("sslmode") != "disable" {
			t.Errorf("%s DATABASE_URL: want sslmode=disable (the postgres image serves no TLS)", name)
		}
		if _, ok := s.Environment["ADMIN_TOKEN"]; !ok {
			t.Errorf("%s: ADMIN_TOKEN must be passed through (empty keeps the admin endpoints off)", name)
		}
	}
	for _, name := range []string{"orders", "relay", "shipping"} {
		s := service(t, p, name)
		amqp, err := url.Parse(env(t, s, "AMQP_URL"))
		if err != nil {
			t.Fatalf("%s AMQP_URL: %v", name, err)
		}
		host, port := hostPort(t, amqp, "5672")
		if amqp.Scheme != "amqp" || host != "rabbitmq" || !exposes(service(t, p, "rabbitmq"), port) {
			t.Errorf("%s AMQP_URL %s: want amqp://...@rabbitmq:5672/", name, amqp.Redacted())
		}
		if amqp.User.Username() != "guest" {
			t.Errorf("%s AMQP_URL user %q: the broker container only has guest", name, amqp.User.Username())
		}
		checkHTTPAddr(t, s)
	}

	sh := service(t, p, "shipping")
	mongo, err := url.Parse(env(t, sh, "MONGO_URI"))
	if err != nil {
		t.Fatalf("shipping MONGO_URI: %v", err)
	}
	host, port := hostPort(t, mongo, "27017")
	if mongo.Scheme != "mongodb" || host != "mongodb" || !exposes(service(t, p, "mongodb"), port) {
		t.Errorf("shipping MONGO_URI %s: want mongodb://mongodb:27017/...", mongo.Redacted())
	}
	if mongo.Query().Get("replicaSet") != "rs0" {
		t.Errorf("shipping MONGO_URI %s: want replicaSet=rs0, or the driver talks to a standalone and the inbox loses its transactions", mongo.Redacted())
	}
	if _, ok := sh.Environment["DATABASE_URL"]; ok {
		t.Errorf("shipping has DATABASE_URL: it must not touch the orders database")
	}

	// The loss audit reads both stores, as the services they belong to.
	audit := service(t, p, "audit")
	for key, from := range map[string]string{"DATABASE_URL": "orders", "MONGO_URI": "shipping"} {
		if got, want := env(t, audit, key), env(t, service(t, p, from), key); got != want {
			t.Errorf("audit %s = %q, want %s's %q", key, got, from, want)
		}
	}
	if cmd := strings.Join(audit.Command, " "); !strings.Contains(cmd, "-every=") || !strings.Contains(cmd, "-metrics-addr=0.0.0.0:9464") {
		t.Errorf("audit command %q: want -every=... and -metrics-addr=0.0.0.0:9464 (its /metrics reachable from Prometheus)", cmd)
	}

	lg := service(t, p, "loadgen")
	if !strings.Contains(strings.Join(lg.Command, " "), "http://orders:8080") {
		t.Errorf("loadgen does not target http://orders:8080: %v", lg.Command)
	}
}

// checkHTTPAddr checks that a service listens on all interfaces (127.0.0.1,
// the services' default, is unreachable from other containers and from
// published ports) on the port its healthcheck probes and its mapping
// publishes.
func checkHTTPAddr(t *testing.T, s types.ServiceConfig) {
	t.Helper()
	host, port, err := net.SplitHostPort(env(t, s, "HTTP_ADDR"))
	if err != nil {
		t.Fatalf("%s HTTP_ADDR: %v", s.Name, err)
	}
	if host != "0.0.0.0" && host != "" {
		t.Errorf("%s HTTP_ADDR host %q: want 0.0.0.0", s.Name, host)
	}
	if s.HealthCheck == nil {
		return // reported by TestHealthchecksAndStartOrder
	}
	probe := s.HealthCheck.Test[len(s.HealthCheck.Test)-1]
	u, err := url.Parse(probe)
	if err != nil || u.Port() != port {
		t.Errorf("%s healthcheck probes %q, but HTTP_ADDR port is %s", s.Name, probe, port)
	}
	for _, pc := range s.Ports {
		if strconv.Itoa(int(pc.Target)) != port {
			t.Errorf("%s publishes container port %d, but HTTP_ADDR port is %s", s.Name, pc.Target, port)
		}
	}
}

// The replica set is started and initiated by the compose file alone, and its
// member name is the host the clients use.
func TestMongoReplicaSetIsInitiated(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	m := service(t, p, "mongodb")
	cmd := strings.Join(m.Command, " ")
	if !strings.Contains(cmd, "--replSet rs0") || !strings.Contains(cmd, "--bind_ip_all") {
		t.Errorf("mongodb command %q: want mongod --replSet rs0 --bind_ip_all", cmd)
	}
	if m.HealthCheck == nil {
		t.Fatal("mongodb has no healthcheck: nothing initiates the replica set")
	}
	script := strings.Join(m.HealthCheck.Test, " ")
	for _, want := range []string{"mongosh", "rs.status()", "rs.initiate(", "_id: 'rs0'", "host: 'mongodb:27017'", "isWritablePrimary", "quit(1)"} {
		if !strings.Contains(script, want) {
			t.Errorf("mongodb healthcheck lacks %q: %s", want, script)
		}
	}
	var hasData bool
	for _, v := range m.Volumes {
		hasData = hasData || (v.Type == types.VolumeTypeVolume && v.Target == "/data/db")
	}
	if !hasData {
		t.Errorf("mongodb: want a named volume on /data/db so the initiated replica set survives a restart")
	}
}

func TestPortsArePublishedOnLoopbackAndCanBeMoved(t *testing.T) {
	t.Parallel()
	defaults := map[string]string{
		"orders:8080": "8080", "shipping:8081": "8081", "postgres:5432": "5432",
		"rabbitmq:5672": "5672", "rabbitmq:15672": "15672", "mongodb:27017": "27017",
		"prometheus:9090": "9090", "grafana:3000": "3000", "alertmanager:9093": "9093",
		"jaeger:16686": "16686", "jaeger:4318": "4318", "audit:9464": "9464",
	}
	check := func(p *types.Project, want map[string]string) {
		t.Helper()
		got := map[string]string{}
		for name, s := range p.Services {
			for _, pc := range s.Ports {
				if pc.HostIP != "127.0.0.1" {
					t.Errorf("%s publishes %d on %q, want 127.0.0.1 only", name, pc.Target, pc.HostIP)
				}
				got[name+":"+strconv.Itoa(int(pc.Target))] = pc.Published
			}
		}
		if len(got) != len(want) {
			t.Errorf("published ports %v, want %v", got, want)
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s published on %q, want %q", k, got[k], v)
			}
		}
	}
	check(load(t, nil), defaults)

	check(load(t, map[string]string{
		"ORDERS_PORT": "18080", "SHIPPING_PORT": "18081", "POSTGRES_PORT": "15432",
		"RABBITMQ_PORT": "15673", "RABBITMQ_UI_PORT": "25672", "MONGO_PORT": "37017",
		"PROMETHEUS_PORT": "19090", "GRAFANA_PORT": "13000", "ALERTMANAGER_PORT": "19093",
		"JAEGER_UI_PORT": "26686", "JAEGER_OTLP_PORT": "14318", "AUDIT_PORT": "19464",
	}), map[string]string{
		"orders:8080": "18080", "shipping:8081": "18081", "postgres:5432": "15432",
		"rabbitmq:5672": "15673", "rabbitmq:15672": "25672", "mongodb:27017": "37017",
		"prometheus:9090": "19090", "grafana:3000": "13000", "alertmanager:9093": "19093",
		"jaeger:16686": "26686", "jaeger:4318": "14318", "audit:9464": "19464",
	})
}

func TestRabbitMQPluginsAndConfig(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	r := service(t, p, "rabbitmq")
	if !strings.Contains(r.Image, "management") {
		t.Errorf("rabbitmq image %q: want a -management image for the UI", r.Image)
	}
	if r.Hostname == "" {
		t.Errorf("rabbitmq: a fixed hostname keeps the node name, and so its data, across re-creation")
	}
	mounts := map[string]string{}
	for _, v := range r.Volumes {
		if v.Type == types.VolumeTypeBind {
			if _, err := os.Stat(v.Source); err != nil {
				t.Errorf("rabbitmq mounts %s, which does not exist: %v", v.Source, err)
			}
			if !v.ReadOnly {
				t.Errorf("rabbitmq mounts %s read-write; want :ro", v.Source)
			}
			mounts[v.Target] = v.Source
		}
	}
	pluginsFile, ok := mounts["/etc/rabbitmq/enabled_plugins"]
	if !ok {
		t.Fatalf("rabbitmq: enabled_plugins is not mounted; mounts: %v", mounts)
	}
	raw, err := os.ReadFile(pluginsFile)
	if err != nil {
		t.Fatal(err)
	}
	plugins := string(raw)
	if !regexp.MustCompile(`^\[[a-z_,\s]*\]\.\s*$`).MatchString(plugins) {
		t.Errorf("%s is not an Erlang list term like [a,b].: %q", pluginsFile, plugins)
	}
	if !strings.Contains(plugins, "rabbitmq_management") {
		t.Errorf("enabled_plugins %q lacks rabbitmq_management (the UI)", plugins)
	}
	// The consistent-hash exchange plugin is on exactly when the code declares
	// such an exchange.
	uses := codeMentions(t, "x-consistent-hash", "../services/shipping", "../pkg")
	if on := strings.Contains(plugins, "rabbitmq_consistent_hash_exchange"); on != uses {
		t.Errorf("rabbitmq_consistent_hash_exchange enabled = %v, but the code declares an x-consistent-hash exchange = %v", on, uses)
	}
	conf, ok := mounts["/etc/rabbitmq/conf.d/90-outbox-inbox.conf"]
	if !ok {
		t.Fatalf("rabbitmq: conf.d file not mounted; mounts: %v", mounts)
	}
	raw, err = os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(raw), "loopback_users.guest = false") {
		t.Errorf("%s must allow guest from other containers", conf)
	}
	// Every node runs with the rabbit environment the tests' nodes run with
	// (the dead-letter worker's confirm timeout).
	cluster := load(t, nil, "cluster")
	for _, name := range []string{"rabbitmq", "rabbitmq-1", "rabbitmq-2", "rabbitmq-3"} {
		var src string
		for _, v := range service(t, cluster, name).Volumes {
			if v.Type == types.VolumeTypeBind && v.Target == "/etc/rabbitmq/advanced.config" {
				src = v.Source
			}
		}
		if src == "" {
			t.Errorf("%s: advanced.config is not mounted", name)
			continue
		}
		raw, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(raw), "["+rabbitnode.RabbitAppEnv+"].") {
			t.Errorf("%s: %s does not hold %s", name, src, rabbitnode.RabbitAppEnv)
		}
	}
}

// codeMentions reports whether a non-test .go file under dirs contains s.
func codeMentions(t *testing.T, s string, dirs ...string) bool {
	t.Helper()
	found := false
	for _, dir := range dirs {
		err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			b, err := os.ReadFile(path)
			found = found || strings.Contains(string(b), s)
			return err
		})
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	return found
}

// dockerfile is what the checks need from a Dockerfile: its stages, each
// stage's instructions with continuation lines joined.
type dockerfile struct {
	stages map[string][]string // stage name -> instructions, FROM first
}

func parseDockerfile(t *testing.T, path string) dockerfile {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	df := dockerfile{stages: map[string][]string{}}
	from := regexp.MustCompile(`(?i)^FROM\s+(\S+)(?:\s+AS\s+(\S+))?$`)
	var cur, line string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		text := strings.TrimSpace(sc.Text())
		if line == "" && (text == "" || strings.HasPrefix(text, "#")) {
			continue
		}
		if strings.HasSuffix(text, `\`) {
			line += strings.TrimSuffix(text, `\`) + " "
			continue
		}
		line = strings.Join(strings.Fields(line+text), " ")
		if m := from.FindStringSubmatch(line); m != nil {
			cur = m[2]
			if cur == "" {
				cur = m[1]
			}
		}
		if cur != "" {
			df.stages[cur] = append(df.stages[cur], line)
		}
		line = ""
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return df
}

// chain returns the instructions of stage and of the stages it is built FROM
// in this Dockerfile, base first.
func (d dockerfile) chain(stage string) []string {
	ins, ok := d.stages[stage]
	if !ok {
		return nil
	}
	parent := strings.Fields(ins[0])[1]
	if _, local := d.stages[parent]; local && parent != stage {
		return append(d.chain(parent), ins...)
	}
	return ins
}

// Each image the compose file builds comes from a Dockerfile and context that
// exist, a target stage that exists, runs as a non-root user, and starts a
// binary that the build stage compiles from a main package of this module;
// the probe its healthcheck runs is in the image too.
func TestImagesAreBuiltFromThisRepository(t *testing.T) {
	t.Parallel()
	p := load(t, nil, "load")
	built := 0
	binaries := map[string]map[string]bool{} // Dockerfile -> binaries its build stage compiles
	for name, s := range p.Services {
		if s.Build == nil {
			if slices.Contains(apps, name) || name == "loadgen" {
				t.Errorf("%s has no build section: application images are built from this repository", name)
			}
			continue
		}
		built++
		ctxDir := s.Build.Context
		if st, err := os.Stat(filepath.Join(ctxDir, "go.mod")); err != nil || st.IsDir() {
			t.Errorf("%s build context %s is not the module root (no go.mod)", name, ctxDir)
		}
		dfPath := s.Build.Dockerfile
		if !filepath.IsAbs(dfPath) {
			dfPath = filepath.Join(ctxDir, dfPath)
		}
		df := parseDockerfile(t, dfPath)
		target := s.Build.Target
		chain := df.chain(target)
		if target == "" || chain == nil {
			t.Errorf("%s build target %q is not a stage of %s (stages: %v)", name, target, dfPath, keys(df.stages))
			continue
		}
		if !slices.ContainsFunc(chain, func(l string) bool { return l == "USER nonroot:nonroot" }) {
			t.Errorf("%s: target %s does not run as nonroot", name, target)
		}
		if !strings.Contains(chain[0], "distroless/static") && !strings.Contains(df.chain("runtime")[0], "distroless/static") {
			t.Errorf("%s: target %s is not a distroless static image", name, target)
		}
		var entry string
		for _, l := range chain {
			if strings.HasPrefix(l, "ENTRYPOINT ") {
				entry = l
			}
		}
		bin := regexp.MustCompile(`^ENTRYPOINT \["(/usr/local/bin/([a-z]+))"\]$`).FindStringSubmatch(entry)
		if bin == nil {
			t.Errorf("%s: target %s has no ENTRYPOINT [\"/usr/local/bin/NAME\"]: %q", name, target, entry)
			continue
		}
		copied := func(path string) bool {
			return slices.ContainsFunc(chain, func(l string) bool {
				return strings.HasPrefix(l, "COPY --from=build /out/") && strings.HasSuffix(l, " "+path)
			})
		}
		if !copied(bin[1]) {
			t.Errorf("%s: target %s does not copy %s from the build stage", name, target, bin[1])
		}
		if binaries[dfPath] == nil {
			binaries[dfPath] = builtPackages(t, df, ctxDir)
		}
		if !binaries[dfPath][bin[2]] {
			t.Errorf("%s: the build stage does not compile a main package named %s", name, bin[2])
		}
		if s.HealthCheck != nil && len(s.HealthCheck.Test) > 1 && !copied(s.HealthCheck.Test[1]) {
			t.Errorf("%s: healthcheck runs %s, which target %s does not contain", name, s.HealthCheck.Test[1], target)
		}
		if s.Image == "" {
			t.Errorf("%s: name the built image (image:) so `docker compose exec` and logs are readable", name)
		}
	}
	if built != 6 {
		t.Errorf("%d services build an image, want 6 (migrate, orders, relay, shipping, loadgen, audit)", built)
	}
}

// builtPackages returns the binaries the build stage's go build compiles
// (the base names of its ./package arguments), after checking that each is a
// main package of the module.
func builtPackages(t *testing.T, df dockerfile, moduleRoot string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, l := range df.stages["build"] {
		if !strings.Contains(l, "go build") {
			continue
		}
		for _, f := range strings.Fields(l) {
			if !strings.HasPrefix(f, "./") {
				continue
			}
			dir := filepath.Join(moduleRoot, f)
			pkg, err := build.ImportDir(dir, 0)
			if err != nil || pkg.Name != "main" {
				t.Errorf("Dockerfile builds %s, which is not a main package here: %v", f, err)
				continue
			}
			out[filepath.Base(f)] = true
		}
	}
	return out
}

func keys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// The data services keep their data in named volumes, so stopping and
// re-running the demo resumes where it was (the outbox survives).
func TestDataIsKeptInNamedVolumes(t *testing.T) {
	t.Parallel()
	p := load(t, nil)
	want := map[string]string{"postgres": "/var/lib/postgresql/data", "rabbitmq": "/var/lib/rabbitmq", "mongodb": "/data/db"}
	for name, target := range want {
		ok := slices.ContainsFunc(service(t, p, name).Volumes, func(v types.ServiceVolumeConfig) bool {
			_, declared := p.Volumes[v.Source]
			return v.Type == types.VolumeTypeVolume && v.Target == target && declared
		})
		if !ok {
			t.Errorf("%s: want a declared named volume on %s", name, target)
		}
	}
}

// The compose PostgreSQL runs with what the WAL relay needs
// (docs/wal-relay.md): wal_level=logical, with replication slots and WAL
// senders to spare.
func TestComposePostgresCanServeTheWALRelay(t *testing.T) {
	t.Parallel()
	pg := service(t, load(t, nil), "postgres")
	settings := map[string]string{}
	for i := 0; i+1 < len(pg.Command); i++ {
		if pg.Command[i] == "-c" {
			k, v, _ := strings.Cut(pg.Command[i+1], "=")
			settings[k] = v
		}
	}
	if len(pg.Command) == 0 || pg.Command[0] != "postgres" || settings["wal_level"] != "logical" {
		t.Errorf("postgres command %v: want postgres -c wal_level=logical", pg.Command)
	}
	for _, k := range []string{"max_replication_slots", "max_wal_senders"} {
		if n, err := strconv.Atoi(settings[k]); err != nil || n < 1 {
			t.Errorf("postgres command %v: want -c %s=N, N >= 1", pg.Command, k)
		}
	}
}

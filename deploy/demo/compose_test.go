package main

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"

	"github.com/outbox-inbox/reference/internal/crashpoint"
)

// fakeRunner records the command lines the compose controller would run
// and answers from canned outputs, keyed by the command line after
// "docker compose -f FILE".
type fakeRunner struct {
	mu      sync.Mutex
	ran     [][]string
	answers map[string]string
	fail    map[string]error
}

func (f *fakeRunner) output(_ context.Context, argv []string) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ran = append(f.ran, argv)
	key := strings.Join(argv[4:], " ")
	if err := f.fail[key]; err != nil {
		return nil, err
	}
	return []byte(f.answers[key]), nil
}

func (f *fakeRunner) lines() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, a := range f.ran {
		out = append(out, strings.Join(a, " "))
	}
	return out
}

const testComposeFile = "deploy/docker-compose.yml"

func wantLines(t *testing.T, f *fakeRunner, want ...string) {
	t.Helper()
	if got := f.lines(); !slices.Equal(got, want) {
		t.Fatalf("ran\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}

func TestComposeControllerCommandLines(t *testing.T) {
	ctx := context.Background()
	f := &fakeRunner{answers: map[string]string{"exec -T rabbitmq rabbitmqctl -q close_all_connections -p / demo: connections cut": "\n"}}
	c := newComposeController(f, testComposeFile)

	if err := c.stop(ctx, "relay", "shipping"); err != nil {
		t.Fatal(err)
	}
	started, err := c.start(ctx, "relay")
	if err != nil || !slices.Equal(started, []string{"relay"}) {
		t.Fatalf("start = %v, %v", started, err)
	}
	if out, err := c.rabbitmqctl(ctx, "close_all_connections", "-p", "/", "demo: connections cut"); err != nil || out != "" {
		t.Fatalf("rabbitmqctl = %q, %v", out, err)
	}
	wantLines(t, f,
		"docker compose -f deploy/docker-compose.yml stop relay shipping",
		"docker compose -f deploy/docker-compose.yml start relay",
		"docker compose -f deploy/docker-compose.yml exec -T rabbitmq rabbitmqctl -q close_all_connections -p / demo: connections cut",
	)
	// The last argument is one argv element, spaces and all.
	if last := f.ran[2]; last[len(last)-1] != "demo: connections cut" {
		t.Fatalf("the reason was split: %q", last)
	}

	since := time.Date(2026, 12, 1, 9, 30, 0, 5e8, time.FixedZone("x", 3600))
	if got, want := strings.Join(c.logsArgv(since), " "),
		"docker compose -f deploy/docker-compose.yml logs --follow --no-color --no-log-prefix --since 2026-12-01T08:30:00.5Z shipping"; got != want {
		t.Fatalf("logs: %s\nwant   %s", got, want)
	}
	if got := strings.Join(c.stopAllArgv(), " "); got != "docker compose -f deploy/docker-compose.yml stop" {
		t.Fatalf("stop all: %s", got)
	}
}

func TestComposeControllerRefusesWhatItCannotDo(t *testing.T) {
	ctx := context.Background()
	f := &fakeRunner{}
	c := newComposeController(f, testComposeFile)
	for _, name := range []string{"postgres", "rabbitmq", "orders", "relay-1", "", "relay; rm -rf /"} {
		if err := c.stop(ctx, name); !errors.Is(err, errBadRequest) {
			t.Errorf("stop %q = %v, want a bad request", name, err)
		}
		if _, err := c.start(ctx, "relay", name); !errors.Is(err, errBadRequest) {
			t.Errorf("start relay %q = %v, want a bad request", name, err)
		}
	}
	if err := c.arm(ctx, "relay", crashpoint.RelayAfterPublishBeforeMark, "x"); !errors.Is(err, errUnsupported) {
		t.Fatalf("arm = %v, want unsupported", err)
	}
	wantLines(t, f) // nothing ran
	f.fail = map[string]error{"stop shipping": errors.New("exit status 1")}
	if err := c.stop(ctx, "shipping"); err == nil {
		t.Fatal("a failed docker compose stop was not reported")
	}
	if c.held["shipping"] {
		t.Fatal("shipping counted as stopped after a failed stop")
	}
}

func TestComposeStatuses(t *testing.T) {
	// Compose 2.21+: one object per line.
	ndjson := `{"Name":"outbox-inbox-postgres-1","Service":"postgres","State":"running","Health":"healthy","Status":"Up 2 minutes (healthy)","ExitCode":0}
{"Name":"outbox-inbox-rabbitmq-1","Service":"rabbitmq","State":"running","Health":"starting","Status":"Up 3 seconds (health: starting)","ExitCode":0}
{"Name":"outbox-inbox-migrate-1","Service":"migrate","State":"exited","Status":"Exited (0) 2 minutes ago","ExitCode":0}
{"Name":"outbox-inbox-orders-1","Service":"orders","State":"restarting","Status":"Restarting (1) 1 second ago","ExitCode":1}
{"Name":"outbox-inbox-relay-1","Service":"relay","State":"exited","Status":"Exited (143) 5 seconds ago","ExitCode":143}
{"Name":"outbox-inbox-relay-2","Service":"relay","State":"running","Health":"healthy","Status":"Up 1 minute (healthy)","ExitCode":0}
{"Name":"outbox-inbox-shipping-1","Service":"shipping","State":"exited","Status":"Exited (143) 5 seconds ago","ExitCode":143}
`
	f := &fakeRunner{answers: map[string]string{"ps --all --format json": ndjson}}
	c := newComposeController(f, testComposeFile)
	c.held["shipping"] = true
	got := c.statuses(context.Background())
	wantLines(t, f, "docker compose -f deploy/docker-compose.yml ps --all --format json")
	want := []procStatus{
		{Name: "postgres", State: procRunning, Health: "healthy"},
		{Name: "rabbitmq", State: procRunning, Health: "starting"},
		{Name: "mongodb", State: procExited, LastExit: "no container"},
		{Name: "orders", State: procRestarting, LastExit: "Restarting (1) 1 second ago"},
		{Name: "relay", State: procRunning, Health: "healthy"},
		{Name: "shipping", State: procStopped, LastExit: "Exited (143) 5 seconds ago"},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("statuses\n  %+v\nwant\n  %+v", got, want)
	}

	// Before 2.21: one array.
	f.answers["ps --all --format json"] = `[{"Name":"a","Service":"relay","State":"exited","Status":"Exited (2)","ExitCode":2}]`
	if st := c.statuses(context.Background())[4]; st.State != procExited || st.LastExit != "Exited (2)" {
		t.Fatalf("relay from an array: %+v", st)
	}
	// docker compose failing: every card says so.
	f.fail = map[string]error{"ps --all --format json": errors.New("Cannot connect to the Docker daemon")}
	for _, st := range c.statuses(context.Background()) {
		if st.State != procExited || !strings.Contains(st.LastExit, "Docker daemon") {
			t.Fatalf("with docker failing: %+v", st)
		}
	}
}

func TestComposePublishedAddr(t *testing.T) {
	f := &fakeRunner{answers: map[string]string{
		"port orders 8080":     "127.0.0.1:18080\n",
		"port shipping 8081":   "0.0.0.0:8081\n[::]:8081\n",
		"port mongodb 27017":   "[::]:27017\n",
		"port rabbitmq 5672":   ":0\n",
		"port postgres 5432":   "\n",
		"port rabbitmq 15672":  "127.0.0.1:15672",
		"port grafana 3000":    "garbage",
		"port prometheus 9090": "127.0.0.1:",
	}}
	c := newComposeController(f, testComposeFile)
	for _, tc := range []struct {
		service string
		port    int
		want    string
	}{
		{"orders", 8080, "127.0.0.1:18080"},
		{"shipping", 8081, "127.0.0.1:8081"},
		{"mongodb", 27017, "127.0.0.1:27017"},
		{"rabbitmq", 15672, "127.0.0.1:15672"},
		{"rabbitmq", 5672, ""},
		{"postgres", 5432, ""},
		{"grafana", 3000, ""},
		{"prometheus", 9090, ""},
	} {
		got, err := c.publishedAddr(context.Background(), tc.service, tc.port)
		if got != tc.want || (err != nil) != (tc.want == "") {
			t.Errorf("publishedAddr(%s, %d) = %q, %v; want %q", tc.service, tc.port, got, err, tc.want)
		}
	}
	if got := f.lines()[0]; got != "docker compose -f deploy/docker-compose.yml port orders 8080" {
		t.Fatalf("ran %s", got)
	}
}

// The page's buttons, served with the compose controller, run exactly
// these docker compose command lines; the crash buttons are not on the page
// and refused.
func TestLiveViewActionsWithCompose(t *testing.T) {
	f := &fakeRunner{}
	c := newComposeController(f, testComposeFile)
	db, mq, mongo := composeURLs("127.0.0.1:5432", "127.0.0.1:5672", "127.0.0.1:27017")
	v := &liveView{d: &demo{cfg: config{DatabaseURL: db, AMQPURL: mq, MongoURI: mongo}}, ctl: c, last: map[string]procStatus{}}
	srv := httptest.NewServer(v.routes())
	t.Cleanup(srv.Close)

	post := func(path string) int {
		t.Helper()
		resp, err := http.Post(srv.URL+path, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	const dc = "docker compose -f deploy/docker-compose.yml "
	for _, tc := range []struct {
		path   string
		status int
		want   []string
	}{
		{"/api/actions/stop-relays", 200, []string{dc + "stop relay"}},
		{"/api/actions/start-relays", 200, []string{dc + "start relay"}},
		{"/api/actions/stop?process=shipping", 200, []string{dc + "stop shipping"}},
		{"/api/actions/start?process=shipping", 200, []string{dc + "start shipping"}},
		{"/api/actions/stop?process=orders", 400, nil},
		{"/api/actions/broker-cut", 200, []string{dc + "exec -T rabbitmq rabbitmqctl -q close_all_connections -p / demo: connections cut"}},
		{"/api/actions/broker-down", 200, []string{
			dc + "exec -T rabbitmq rabbitmqctl -q clear_permissions -p / guest",
			dc + "exec -T rabbitmq rabbitmqctl -q close_all_connections -p / demo: broker outage",
		}},
		{"/api/actions/broker-up", 200, []string{dc + "exec -T rabbitmq rabbitmqctl -q set_permissions -p / guest .* .* .*"}},
		{"/api/actions/broker-stop-app", 200, []string{dc + "exec -T rabbitmq rabbitmqctl -q stop_app"}},
		{"/api/actions/broker-start-app", 200, []string{dc + "exec -T rabbitmq rabbitmqctl -q start_app"}},
		{"/api/actions/crash-relay", 501, nil},
		{"/api/actions/crash-shipping", 501, nil},
	} {
		f.ran = nil
		if got := post(tc.path); got != tc.status {
			t.Errorf("POST %s: %d, want %d", tc.path, got, tc.status)
		}
		if got := f.lines(); !slices.Equal(got, tc.want) {
			t.Errorf("POST %s ran\n  %s\nwant\n  %s", tc.path, strings.Join(got, "\n  "), strings.Join(tc.want, "\n  "))
		}
	}
	for _, a := range v.actions() {
		if a.crash {
			t.Errorf("action %s arms a crash point and is offered with compose", a.Name)
		}
	}
	for _, a := range v.actions() {
		if strings.Contains(a.What, "relay-1") || strings.Contains(a.What, "relay-2") {
			t.Errorf("action %s says %q under compose, which has no relay-1 or relay-2", a.Name, a.What)
		}
	}
	if len(v.actions()) != len(actions)-2 {
		t.Errorf("%d actions with compose, want all but the two crashes (%d)", len(v.actions()), len(actions)-2)
	}
}

// Everything the compose controller relies on exists in
// deploy/docker-compose.yml, loaded by compose-go as `docker compose
// config` does (default environment, no profile): the services it shows,
// stops, starts and execs into, the ports it reads, the credentials and
// databases it dials, the healthchecks the relay's card reads, and the
// switches deploy/demo.sh sets.
func TestComposeControllerMatchesTheComposeFile(t *testing.T) {
	file := filepath.Join("..", "docker-compose.yml")
	load := func(env ...string) *types.Project {
		t.Helper()
		opts, err := cli.NewProjectOptions([]string{file}, cli.WithWorkingDirectory(".."), cli.WithEnv(env), cli.WithResolvedPaths(true))
		if err != nil {
			t.Fatal(err)
		}
		p, err := opts.LoadProject(context.Background())
		if err != nil {
			t.Fatalf("load %s: %v", file, err)
		}
		return p
	}
	p := load()
	svc := func(name string) types.ServiceConfig {
		t.Helper()
		s, ok := p.Services[name]
		if !ok {
			t.Fatalf("the compose controller relies on service %q; %s has %v", name, file, p.ServiceNames())
		}
		return s
	}
	envOf := func(s types.ServiceConfig, k string) string {
		if v := s.Environment[k]; v != nil {
			return *v
		}
		return ""
	}

	for _, pp := range append(composePublished, composeJaeger) {
		s := svc(pp.Service)
		found := false
		for _, port := range s.Ports {
			if port.Target == uint32(pp.Port) && port.Published != "" {
				found = true
				if port.HostIP != "127.0.0.1" {
					t.Errorf("%s:%d is published on %q, not loopback", pp.Service, pp.Port, port.HostIP)
				}
			}
		}
		if !found {
			t.Errorf("the live view reads %s's port %d from the host; it is not published", pp.Service, pp.Port)
		}
	}
	for _, pi := range composeProcesses {
		s := svc(pi.Name)
		if len(s.Profiles) > 0 {
			t.Errorf("service %s is shown as a process but only runs with profiles %v", pi.Name, s.Profiles)
		}
		if s.HealthCheck == nil || len(s.HealthCheck.Test) == 0 {
			t.Errorf("service %s has no healthcheck: its card's readiness reads it", pi.Name)
		}
		if pi.Stoppable && s.Restart != "unless-stopped" {
			t.Errorf("service %s: restart %q; stop/start from the page assume unless-stopped", pi.Name, s.Restart)
		}
		if roles[pi.Name] == "" {
			t.Errorf("service %s has no role on the page", pi.Name)
		}
	}
	for _, r := range (&composeController{}).relays() {
		if !slices.ContainsFunc(composeProcesses, func(pi processInfo) bool { return pi.Name == r && pi.Stoppable }) {
			t.Errorf("relay %s is not a stoppable process", r)
		}
	}
	if s := svc("relay"); !slices.Equal([]string(s.Command), []string{"relay"}) {
		t.Errorf("service relay runs %v, not the relay", s.Command)
	}
	if img := svc("rabbitmq").Image; !strings.HasPrefix(img, "rabbitmq:") {
		t.Errorf("rabbitmq image %q: the broker buttons exec rabbitmqctl in the official image", img)
	}

	// The URLs the live view dials are the services' own, with the
	// published port as the host.
	db, mq, mongo := composeURLs("h:1", "h:2", "h:3")
	pg := svc("postgres")
	du, _ := url.Parse(db)
	pass, _ := du.User.Password()
	if du.User.Username() != envOf(pg, "POSTGRES_USER") || pass != envOf(pg, "POSTGRES_PASSWORD") || du.Path != "/"+envOf(pg, "POSTGRES_DB") {
		t.Errorf("live view's DATABASE_URL %s does not match postgres's POSTGRES_USER/PASSWORD/DB", db)
	}
	ou, err := url.Parse(envOf(svc("orders"), "DATABASE_URL"))
	if err != nil || ou.User.String() != du.User.String() || ou.Path != du.Path {
		t.Errorf("orders's DATABASE_URL %v and the live view's %s differ in user or database", ou, db)
	}
	for _, name := range []string{"orders", "relay", "shipping"} {
		au, err := url.Parse(envOf(svc(name), "AMQP_URL"))
		mu, _ := url.Parse(mq)
		if err != nil || au.User.String() != mu.User.String() || strings.TrimPrefix(au.Path, "/") != strings.TrimPrefix(mu.Path, "/") {
			t.Errorf("%s's AMQP_URL %v and the live view's %s differ in user or vhost", name, au, mq)
		}
	}
	if got := mongoDatabase(envOf(svc("shipping"), "MONGO_URI")); got != mongoDatabase(mongo) {
		t.Errorf("shipping's database %q, the live view reads %q", got, mongoDatabase(mongo))
	}

	// deploy/demo.sh's switches: the API without its own relay, and
	// shipping's per-delivery debug lines (the delivered and duplicate
	// counts) in its log.
	script, err := os.ReadFile(filepath.Join("..", "demo.sh"))
	if err != nil {
		t.Fatal(err)
	}
	exported := map[string]bool{}
	for _, line := range strings.Split(string(script), "\n") {
		if f := strings.Fields(line); len(f) > 1 && f[0] == "export" {
			for _, kv := range f[1:] {
				exported[kv] = true
			}
		}
	}
	for _, kv := range []string{"ORDERS_RELAY=false", "LOG_LEVEL=debug"} {
		if !exported[kv] {
			t.Errorf("deploy/demo.sh does not export %s", kv)
		}
	}
	for _, s := range []string{`up --build --detach --wait "$@"`, "bin/demo -compose deploy/docker-compose.yml"} {
		if !strings.Contains(string(script), s) {
			t.Errorf("deploy/demo.sh does not run %s", s)
		}
	}
	p = load("ORDERS_RELAY=false", "LOG_LEVEL=debug")
	if got := envOf(p.Services["orders"], "RELAY"); got != "false" {
		t.Errorf("ORDERS_RELAY=false gives orders RELAY=%q", got)
	}
	if got := envOf(p.Services["shipping"], "LOG_LEVEL"); got != "debug" {
		t.Errorf("LOG_LEVEL=debug gives shipping LOG_LEVEL=%q", got)
	}
	if got := envOf(load().Services["orders"], "RELAY"); got != "true" {
		t.Errorf("by default orders has RELAY=%q, want its relay on", got)
	}
}

// With -compose the demo runs no binaries of its own: none are needed, and
// the compose file must exist.
func TestConfigComposeMode(t *testing.T) {
	file := filepath.Join(t.TempDir(), "docker-compose.yml")
	if err := os.WriteFile(file, []byte("services: {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	noEnv := func(string) string { return "" }
	var out strings.Builder
	if _, err := parseConfig([]string{"-compose", file, "-bin", t.TempDir()}, noEnv, &out); err != nil {
		t.Fatalf("-compose with an empty -bin: %v", err)
	}
	if _, err := parseConfig([]string{"-compose", file + ".missing"}, noEnv, &out); err == nil || !strings.Contains(err.Error(), "-compose") {
		t.Fatalf("-compose with a missing file: %v", err)
	}
	if _, err := parseConfig([]string{"-compose", file, "-ui-addr", "nowhere"}, noEnv, &out); err == nil || !strings.Contains(err.Error(), "-ui-addr") {
		t.Fatalf("-compose with a bad -ui-addr: %v", err)
	}
	if _, err := parseConfig([]string{"-bin", t.TempDir()}, noEnv, &out); err == nil {
		t.Fatal("without -compose, an empty -bin was accepted")
	}
}

package main

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Compose mode (-compose FILE): with a Docker engine, deploy/demo.sh starts
// the system with `docker compose up --detach --wait` and then runs this
// binary on the host to serve the same live view. Nothing is started here:
// the page reads the services through the ports compose publishes on the
// host (the orders and shipping APIs, PostgreSQL, RabbitMQ, MongoDB), the
// containers' states and healthchecks through `docker compose ps`, and
// shipping's deliveries through `docker compose logs`. Its buttons act with
// `docker compose stop/start SERVICE` and, for the broker, `docker compose
// exec rabbitmq rabbitmqctl ...`. Crash points need the process's
// environment at start, which a running compose project does not give, so
// those two buttons are the local supervisor's only.

// commandRunner runs one command line and returns its combined output; the
// compose controller's only way out (tests substitute a recorder).
type commandRunner interface {
	output(ctx context.Context, argv []string) ([]byte, error)
}

// execRunner runs commands for real.
type execRunner struct{}

func (execRunner) output(ctx context.Context, argv []string) ([]byte, error) {
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, bytes.TrimSpace(out))
	}
	return out, nil
}

// composePublished are the ports the live view reads from the host: the
// service and the container port whose published address it asks
// `docker compose port` for. deploy/demo's compose test checks each against
// deploy/docker-compose.yml.
var composePublished = []struct {
	Service string
	Port    int
}{
	{"orders", 8080},
	{"shipping", 8081},
	{"postgres", 5432},
	{"rabbitmq", 5672},
	{"mongodb", 27017},
}

// composeJaeger is the tracing UI's published port, which the journey's
// trace links point at when the project publishes it.
var composeJaeger = struct {
	Service string
	Port    int
}{"jaeger", 16686}

// composeProcesses are the page's process cards in compose mode, one per
// service; Stoppable ones have stop and start buttons.
var composeProcesses = []processInfo{
	{Name: "postgres"}, {Name: "rabbitmq"}, {Name: "mongodb"},
	{Name: "orders"}, {Name: "relay", Stoppable: true}, {Name: "shipping", Stoppable: true},
}

// The credentials and databases of deploy/docker-compose.yml (its
// POSTGRES_* variables, the services' DATABASE_URL, AMQP_URL and MONGO_URI;
// the compose test checks them), with the host part the published port.
func composeURLs(pg, mq, mongo string) (database, amqpURL, mongoURI string) {
	return "postgres://postgres:postgres@" + pg + "/orders?sslmode=disable",
		"amqp://guest:guest@" + mq + "/",
		// The replica set's member is "mongodb:27017", a name only the
		// containers resolve: talk to the published port directly.
		"mongodb://" + mongo + "/shipping?directConnection=true"
}

// composeController is the live view's process controller on a compose
// project.
type composeController struct {
	run  commandRunner
	base []string // docker compose -f FILE

	mu   sync.Mutex
	held map[string]bool // stopped from the page
}

func newComposeController(run commandRunner, file string) *composeController {
	return &composeController{run: run, base: []string{"docker", "compose", "-f", file}, held: map[string]bool{}}
}

func (c *composeController) argv(args ...string) []string {
	return append(append([]string(nil), c.base...), args...)
}

func (c *composeController) mode() string { return "docker compose (" + c.base[3] + ")" }

func (c *composeController) processes() []processInfo {
	out := make([]processInfo, len(composeProcesses))
	for i, p := range composeProcesses {
		p.Role = roles[p.Name]
		out[i] = p
	}
	return out
}

func (c *composeController) relays() []string { return []string{"relay"} }

func (c *composeController) service(name string) error {
	for _, p := range composeProcesses {
		if p.Name == name && p.Stoppable {
			return nil
		}
	}
	return fmt.Errorf("%w: service %q: want relay or shipping", errBadRequest, name)
}

// stop runs `docker compose stop SERVICE...`: SIGTERM, then SIGKILL after
// the service's grace period; a stopped container is not restarted by its
// restart policy.
func (c *composeController) stop(ctx context.Context, names ...string) error {
	for _, n := range names {
		if err := c.service(n); err != nil {
			return err
		}
	}
	if _, err := c.run.output(ctx, c.argv(append([]string{"stop"}, names...)...)); err != nil {
		return err
	}
	c.mu.Lock()
	for _, n := range names {
		c.held[n] = true
	}
	c.mu.Unlock()
	return nil
}

// start runs `docker compose start SERVICE...`, which leaves running
// containers alone.
func (c *composeController) start(ctx context.Context, names ...string) ([]string, error) {
	for _, n := range names {
		if err := c.service(n); err != nil {
			return nil, err
		}
	}
	if _, err := c.run.output(ctx, c.argv(append([]string{"start"}, names...)...)); err != nil {
		return nil, err
	}
	c.mu.Lock()
	for _, n := range names {
		delete(c.held, n)
	}
	c.mu.Unlock()
	return names, nil
}

func (c *composeController) arm(context.Context, string, string, string) error {
	return fmt.Errorf("%w with docker compose: a crash point is armed in the process's environment at start (the local demo does it: DEMO_MODE=local make demo)", errUnsupported)
}

// rabbitmqctl runs `docker compose exec -T rabbitmq rabbitmqctl -q ARGS`
// (the broker container's own rabbitmqctl).
func (c *composeController) rabbitmqctl(ctx context.Context, args ...string) (string, error) {
	out, err := c.run.output(ctx, c.argv(append([]string{"exec", "-T", "rabbitmq", "rabbitmqctl", "-q"}, args...)...))
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(out)), nil
}

// composeContainer is one line of `docker compose ps --format json`.
type composeContainer struct {
	Name     string `json:"Name"`
	Service  string `json:"Service"`
	State    string `json:"State"`
	Health   string `json:"Health"`
	Status   string `json:"Status"`
	ExitCode int    `json:"ExitCode"`
}

// parsePS reads `docker compose ps --format json`: one JSON object per line
// (Compose 2.21 and later) or one JSON array (before).
func parsePS(out []byte) ([]composeContainer, error) {
	out = bytes.TrimSpace(out)
	var cs []composeContainer
	if len(out) > 0 && out[0] == '[' {
		if err := json.Unmarshal(out, &cs); err != nil {
			return nil, fmt.Errorf("docker compose ps: %w", err)
		}
		return cs, nil
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var c composeContainer
		if err := json.Unmarshal(line, &c); err != nil {
			return nil, fmt.Errorf("docker compose ps: %w", err)
		}
		cs = append(cs, c)
	}
	return cs, sc.Err()
}

// statuses runs `docker compose ps --all --format json`: one card per
// service; with several replicas (relay), running if any runs.
func (c *composeController) statuses(ctx context.Context) []procStatus {
	out := make([]procStatus, len(composeProcesses))
	for i, p := range composeProcesses {
		out[i] = procStatus{Name: p.Name, State: procExited, LastExit: "no container"}
	}
	raw, err := c.run.output(ctx, c.argv("ps", "--all", "--format", "json"))
	var cs []composeContainer
	if err == nil {
		cs, err = parsePS(raw)
	}
	if err != nil {
		for i := range out {
			out[i].LastExit = err.Error()
		}
		return out
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range out {
		st := &out[i]
		var mine []composeContainer
		for _, ct := range cs {
			if ct.Service == st.Name {
				mine = append(mine, ct)
			}
		}
		*st = serviceStatus(st.Name, mine, c.held[st.Name])
	}
	return out
}

// serviceStatus folds a service's containers into one card.
func serviceStatus(name string, cs []composeContainer, held bool) procStatus {
	st := procStatus{Name: name, State: procExited, LastExit: "no container"}
	if len(cs) == 0 {
		return st
	}
	rank := map[string]int{"running": 3, "restarting": 2}
	best := cs[0]
	for _, ct := range cs[1:] {
		if rank[ct.State] > rank[best.State] {
			best = ct
		}
	}
	st.LastExit = best.Status
	switch best.State {
	case "running":
		st.State, st.Health, st.LastExit = procRunning, best.Health, ""
		for _, ct := range cs {
			if ct.State == "running" && ct.Health != "" && ct.Health != "healthy" {
				st.Health = ct.Health
			}
		}
	case "restarting":
		st.State = procRestarting
	default:
		if held {
			st.State = procStopped
		}
	}
	return st
}

// publishedAddr runs `docker compose port SERVICE PORT` and returns the
// host:port to dial (a wildcard address becomes loopback).
func (c *composeController) publishedAddr(ctx context.Context, service string, port int) (string, error) {
	out, err := c.run.output(ctx, c.argv("port", service, strconv.Itoa(port)))
	if err != nil {
		return "", err
	}
	line := strings.TrimSpace(string(out))
	if i := strings.IndexByte(line, '\n'); i >= 0 {
		line = strings.TrimSpace(line[:i])
	}
	host, p, err := net.SplitHostPort(line)
	if err != nil || p == "" || p == "0" {
		return "", fmt.Errorf("docker compose port %s %d: %q: not published (is the project up?)", service, port, line)
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, p), nil
}

// logsArgv is the command line that follows shipping's log from since on.
func (c *composeController) logsArgv(since time.Time) []string {
	return c.argv("logs", "--follow", "--no-color", "--no-log-prefix", "--since", since.UTC().Format(time.RFC3339Nano), "shipping")
}

// stopAllArgv stops the whole project (containers and volumes are kept).
func (c *composeController) stopAllArgv() []string { return c.argv("stop") }

// runCompose serves the live view on a running compose project until ctx
// ends, then stops the project.
func runCompose(ctx context.Context, cfg config, stdout io.Writer) error {
	ctl := newComposeController(execRunner{}, cfg.Compose)
	d := newDemo(cfg, stdout)
	d.ctl = ctl
	addrs := map[string]string{}
	for _, p := range composePublished {
		a, err := ctl.publishedAddr(ctx, p.Service, p.Port)
		if err != nil {
			return fmt.Errorf("read the compose project's ports (it keeps running; %s stops it): %w", strings.Join(ctl.stopAllArgv(), " "), err)
		}
		addrs[p.Service] = a
	}
	d.cfg.OrdersAddr, d.cfg.ShippingAddr = addrs["orders"], addrs["shipping"]
	d.cfg.RelayAddr, d.cfg.Relay2Addr = "", "" // the relay publishes no port
	d.cfg.AuditAddr = ""                       // the project runs no continuous audit
	d.cfg.DatabaseURL, d.cfg.AMQPURL, d.cfg.MongoURI = composeURLs(addrs["postgres"], addrs["rabbitmq"], addrs["mongodb"])
	if d.cfg.JaegerUI == "" {
		// Optional: without it the journey shows trace ids, unlinked.
		if a, err := ctl.publishedAddr(ctx, composeJaeger.Service, composeJaeger.Port); err == nil {
			d.cfg.JaegerUI = "http://" + a
		}
	}

	fctx, stopFollow := context.WithCancel(ctx)
	followed := make(chan struct{})
	go func() {
		defer close(followed)
		d.followShipping(fctx, ctl)
	}()
	defer func() { stopFollow(); <-followed }()

	view, err := startLiveView(ctx, d)
	if err != nil {
		return err
	}
	d.composeBanner(ctl)
	<-ctx.Done()
	err = view.close()
	d.say("stopping the compose project: %s", strings.Join(ctl.stopAllArgv(), " "))
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, serr := ctl.run.output(sctx, ctl.stopAllArgv()); serr != nil {
		err = errors.Join(err, serr)
	}
	return err
}

// followShipping feeds shipping's log to the delivery log (and its other
// lines to the terminal), following it again from where it broke off if
// `docker compose logs --follow` ends while the demo runs.
func (d *demo) followShipping(ctx context.Context, ctl *composeController) {
	out := newPrefixer(d.term, "shipping", nameWidth)
	out.keep = d.deliveries.line
	since := time.Now()
	for ctx.Err() == nil {
		argv := ctl.logsArgv(since)
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Stdout, cmd.Stderr = out, out
		err := cmd.Run()
		since = time.Now()
		if ctx.Err() != nil {
			return
		}
		d.say("docker compose logs shipping ended (%v); following again", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(2 * time.Second):
		}
	}
}

func (d *demo) composeBanner(ctl *composeController) {
	c := d.cfg
	for _, l := range []string{
		"",
		"the compose project is up; Ctrl-C stops it (docker compose stop; volumes are kept)",
		"",
		fmt.Sprintf("  LIVE VIEW     http://%s        <- open this: watch the flow, break things with a click", c.UIAddr),
		"",
		fmt.Sprintf("  orders API    http://%s", c.OrdersAddr),
		fmt.Sprintf("  shipping API  http://%s", c.ShippingAddr),
		fmt.Sprintf("  PostgreSQL    %s", redacted(c.DatabaseURL)),
		fmt.Sprintf("  RabbitMQ      %s  (management UI: docker compose port rabbitmq 15672)", redacted(c.AMQPURL)),
		fmt.Sprintf("  MongoDB       %s", redacted(c.MongoURI)),
		"  logs          " + strings.Join(ctl.argv("logs", "--follow"), " "),
		"  Jaeger        " + cmp.Or(c.JaegerUI, "not published: the journey shows trace ids without links"),
		"  guided tour: docs/demo.md",
		"",
	} {
		d.say("%s", l)
	}
}

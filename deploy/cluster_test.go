package deploy_test

import (
	"bufio"
	"net/url"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/types"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

var clusterNodes = []string{"rabbitmq-1", "rabbitmq-2", "rabbitmq-3"}

// readEnvFile reads KEY=VALUE lines, as docker compose --env-file does for
// this simple file.
func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: line %q is not KEY=VALUE", path, line)
		}
		env[k] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return env
}

// The cluster variant: three RabbitMQ nodes in the cluster profile, off by
// default, clustered by name with one cookie, and the services' AMQP_URL
// listing all three (docs/cluster.md).
func TestClusterProfile(t *testing.T) {
	t.Parallel()
	def := load(t, nil)
	for _, n := range clusterNodes {
		if _, ok := def.DisabledServices[n]; !ok {
			t.Errorf("%s must exist but be off without the cluster profile", n)
		}
	}

	env := readEnvFile(t, "cluster.env")
	if env["COMPOSE_PROFILES"] != "cluster" {
		t.Errorf("cluster.env COMPOSE_PROFILES = %q, want cluster", env["COMPOSE_PROFILES"])
	}
	p := load(t, env, strings.Split(env["COMPOSE_PROFILES"], ",")...)

	conf, err := os.ReadFile("rabbitmq/cluster.conf")
	if err != nil {
		t.Fatal(err)
	}
	cookie := ""
	for i, name := range clusterNodes {
		s := service(t, p, name)
		if !slices.Equal(s.Profiles, []string{"cluster"}) {
			t.Errorf("%s profiles = %v, want [cluster]", name, s.Profiles)
		}
		if s.Hostname != name {
			t.Errorf("%s hostname = %q: the node name rabbit@%s follows it", name, s.Hostname, name)
		}
		if !strings.Contains(string(conf), "rabbit@"+name) {
			t.Errorf("rabbitmq/cluster.conf does not list rabbit@%s", name)
		}
		c := env0(s, "RABBITMQ_ERLANG_COOKIE")
		if c == "" || i > 0 && c != cookie {
			t.Errorf("%s Erlang cookie %q: every node needs the same one", name, c)
		}
		cookie = c
		if s.HealthCheck == nil || len(s.HealthCheck.Test) == 0 {
			t.Errorf("%s has no healthcheck", name)
		}
		if !exposes(s, "5672") {
			t.Errorf("%s does not expose 5672", name)
		}
		mounted := false
		for _, v := range s.Volumes {
			mounted = mounted || strings.HasSuffix(v.Source, "rabbitmq/cluster.conf") && strings.HasPrefix(v.Target, "/etc/rabbitmq/conf.d/")
		}
		if !mounted {
			t.Errorf("%s does not mount rabbitmq/cluster.conf into /etc/rabbitmq/conf.d", name)
		}
	}
	if !strings.Contains(string(conf), "peer_discovery_backend = classic_config") {
		t.Error("rabbitmq/cluster.conf: want classic_config peer discovery")
	}

	for _, name := range []string{"orders", "relay", "shipping", "migrate"} {
		s := service(t, p, name)
		urls, err := outboxamqp.ParseURLs(env0(s, "AMQP_URL"))
		if err != nil {
			t.Fatalf("%s AMQP_URL: %v", name, err)
		}
		var hosts []string
		for _, raw := range urls {
			u, err := url.Parse(raw)
			if err != nil {
				t.Fatal(err)
			}
			host, port := hostPort(t, u, "5672")
			if port != "5672" || u.User.Username() != "guest" {
				t.Errorf("%s AMQP_URL entry %s: want amqp://guest:...@<node>:5672/", name, u.Redacted())
			}
			hosts = append(hosts, host)
		}
		if !slices.Equal(hosts, clusterNodes) {
			t.Errorf("%s AMQP_URL lists %v, want every node %v", name, hosts, clusterNodes)
		}
	}
}

// env0 is the service's environment variable, "" when unset.
func env0(s types.ServiceConfig, key string) string {
	if v := s.Environment[key]; v != nil {
		return *v
	}
	return ""
}

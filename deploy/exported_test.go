package deploy_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
	"go.yaml.in/yaml/v3"
)

// Every query the dashboard and the rules run parses as PromQL and names
// only metrics that are really exported: the orders API, a standalone relay
// and the shipping consumer are built from this repository, started against
// the local PostgreSQL and RabbitMQ, and their /metrics scraped, as are
// postgres_exporter with the compose file's queries (beside a WAL relay's
// slot) and the rabbitmq_prometheus plugin of a RabbitMQ node of the test's
// own; a query may also name a recording rule or a series Prometheus makes
// itself (up, ALERTS, ...).
func TestQueriesNameOnlyExportedMetrics(t *testing.T) {
	t.Parallel()
	queries := dashboardQueries(t)
	rules := append(readRules(t, recordRules), readRules(t, alertRules)...)
	for _, r := range rules {
		// Watchdog's vector(1) reads no series: that is its point.
		queries = append(queries, query{source: "rule " + r.Record + r.Alert, expr: r.Expr, readsNothing: alwaysFiring[r.Alert]})
	}

	parseWithPromtool(t, queries)

	known := exportedMetrics(t)
	for _, name := range []string{"up", "scrape_duration_seconds", "scrape_samples_scraped",
		"scrape_samples_post_metric_relabeling", "scrape_series_added", "ALERTS", "ALERTS_FOR_STATE"} {
		known[name] = true // series Prometheus itself writes
	}
	for _, r := range rules {
		if r.Record != "" {
			known[r.Record] = true
		}
	}
	for _, q := range queries {
		names, err := metricNames(q.expr)
		if err != nil {
			t.Errorf("%s: %v", q.source, err)
			continue
		}
		if len(names) == 0 && !q.readsNothing {
			t.Errorf("%s: %q names no metric", q.source, q.expr)
		}
		for _, n := range names {
			if !known[n] {
				t.Errorf("%s: %q names %s, which no service exports", q.source, q.expr, n)
			}
		}
	}
}

// query is one PromQL expression and where it comes from; readsNothing
// allows it to name no metric.
type query struct {
	source, expr string
	readsNothing bool
}

// dashboardQueries returns the queries of every provisioned dashboard's
// panels, with Grafana's interval variables replaced by durations.
func dashboardQueries(t *testing.T) []query {
	t.Helper()
	files, err := filepath.Glob("grafana/dashboards/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no dashboard in grafana/dashboards: %v", err)
	}
	vars := strings.NewReplacer("$__rate_interval", "1m", "$__interval", "15s", "$__range", "1h")
	var qs []query
	for _, f := range files {
		d := readDashboard(t, f)
		for _, p := range d.panels() {
			if len(p.Targets) == 0 {
				t.Errorf("%s: panel %q has no query", f, p.Title)
			}
			for _, q := range p.Targets {
				if strings.TrimSpace(q.Expr) == "" {
					t.Errorf("%s: panel %q query %s is empty", f, p.Title, q.RefID)
					continue
				}
				expr := vars.Replace(q.Expr)
				if strings.Contains(expr, "$") {
					t.Errorf("%s: panel %q uses a variable this test does not know: %s", f, p.Title, q.Expr)
					continue
				}
				qs = append(qs, query{source: fmt.Sprintf("%s panel %q query %s", filepath.Base(f), p.Title, q.RefID), expr: expr})
			}
		}
	}
	return qs
}

// parseWithPromtool checks that every query parses, with the PromQL parser
// of promtool: each becomes a recording rule of a scratch rule file, which
// `promtool check rules` parses.
func parseWithPromtool(t *testing.T, queries []query) {
	t.Helper()
	type ruleDoc struct {
		Record string `yaml:"record"`
		Expr   string `yaml:"expr"`
	}
	type groupDoc struct {
		Name  string    `yaml:"name"`
		Rules []ruleDoc `yaml:"rules"`
	}
	var doc struct {
		Groups []groupDoc `yaml:"groups"`
	}
	for i, q := range queries {
		doc.Groups = append(doc.Groups, groupDoc{Name: fmt.Sprintf("q%d %s", i, q.source), Rules: []ruleDoc{{Record: "check:query", Expr: q.expr}}})
	}
	raw, err := yaml.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "queries.yml")
	if err := os.WriteFile(f, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := runPromtool(t, ".", "check", "rules", f); err != nil {
		t.Fatalf("promtool check rules on the dashboard's and rules' queries: %v\n%s", err, out)
	}
}

var (
	promqlKeywords = map[string]bool{
		"and": true, "or": true, "unless": true, "bool": true, "offset": true, "atan2": true,
		"inf": true, "nan": true, "start": true, "end": true,
	}
	// promqlGrouping are followed by a list of label names in parentheses.
	promqlGrouping = map[string]bool{
		"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	}
	promqlAggregations = map[string]bool{
		"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
		"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
		"limitk": true, "limit_ratio": true,
	}
)

// metricNames returns the metric names an expression selects (promtool has
// checked that it parses). It reads PromQL's tokens: an identifier is a
// metric name unless it is a keyword, an aggregation, a function (followed
// by "("), or a label name inside {...} or a by/without/on/ignoring list;
// strings, numbers, durations and [...] ranges are skipped. A selector by
// __name__ is refused: name the metric.
func metricNames(expr string) ([]string, error) {
	var names []string
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	nextNonSpace := func(i int) int {
		for i < len(expr) && strings.ContainsRune(" \t\r\n", rune(expr[i])) {
			i++
		}
		return i
	}
	// skipString returns the index just past the string quoted at i.
	skipString := func(i int) int {
		q := expr[i]
		for i++; i < len(expr) && expr[i] != q; i++ {
			if expr[i] == '\\' && q != '`' {
				i++
			}
		}
		return i + 1
	}
	// skipTo returns the index just past the close matching the open at i,
	// skipping quoted strings.
	skipTo := func(i int, open, close byte) (int, error) {
		depth := 0
		for j := i; j < len(expr); {
			switch c := expr[j]; c {
			case '"', '\'', '`':
				j = skipString(j)
				continue
			case open:
				depth++
			case close:
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
			j++
		}
		return 0, fmt.Errorf("unbalanced %c in %q", open, expr)
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '#':
			for i < len(expr) && expr[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			i = skipString(i)
		case c == '{':
			end, err := skipTo(i, '{', '}')
			if err != nil {
				return nil, err
			}
			if regexp.MustCompile(`(^|[{,\s])__name__\s*(=|!=|=~|!~)`).MatchString(expr[i:end]) {
				return nil, fmt.Errorf("%q selects by __name__: name the metric instead", expr)
			}
			i = end
		case c == '[':
			end, err := skipTo(i, '[', ']')
			if err != nil {
				return nil, err
			}
			i = end
		case c >= '0' && c <= '9' || c == '.' && i+1 < len(expr) && expr[i+1] >= '0' && expr[i+1] <= '9':
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word := expr[i:j]
			next := nextNonSpace(j)
			lower := strings.ToLower(word)
			switch {
			case promqlGrouping[lower]:
				if next < len(expr) && expr[next] == '(' {
					end, err := skipTo(next, '(', ')')
					if err != nil {
						return nil, err
					}
					j = end
				}
			case promqlKeywords[lower], promqlAggregations[lower]:
			case next < len(expr) && expr[next] == '(':
				// a function call
			default:
				if !slices.Contains(names, word) {
					names = append(names, word)
				}
			}
			i = j
		default:
			i++
		}
	}
	return names, nil
}

// The name extraction itself, on the shapes the dashboard and rules use.
func TestMetricNames(t *testing.T) {
	t.Parallel()
	for expr, want := range map[string][]string{
		`sum by (job, instance) (rate(outbox_published_total{job=~"orders|relay"}[5m]))`:                    {"outbox_published_total"},
		`histogram_quantile(0.99, sum by (le) (rate(outbox_confirm_latency_seconds_bucket[5m]))) > 1`:       {"outbox_confirm_latency_seconds_bucket"},
		`max(outbox_pending) - max(outbox_pending offset 5m) > 0 unless on () sum(increase(a:b:c[5m])) > 0`: {"outbox_pending", "a:b:c"},
		`count(ALERTS{alertstate="firing", x="by (y) z"}) or vector(0)`:                                     {"ALERTS"},
		`foo / ignoring(code) group_left(extra) bar * 1e3 and bool baz`:                                     {"foo", "bar", "baz"},
		`sum without (instance) (x[5m:1m]) # a comment naming not_a_metric`:                                 {"x"},
	} {
		got, err := metricNames(expr)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("metricNames(%q) = %v, %v; want %v", expr, got, err, want)
		}
	}
	if _, err := metricNames(`{__name__="outbox_pending"}`); err == nil {
		t.Errorf("a selector by __name__ was accepted")
	}
}

// exportedMetrics builds the services, runs them against the local
// PostgreSQL and RabbitMQ (a database and a vhost of this test's own), and
// returns every metric name their /metrics show, with the _bucket, _sum and
// _count series of histograms and summaries.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	dbURL := scratchDatabase(t)
	amqpURL := scratchVhost(t)
	bin := t.TempDir()
	build := exec.Command("go", "build", "-o", bin+string(filepath.Separator), "./services/orders", "./services/shipping")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	orders, shipping := filepath.Join(bin, "orders"), filepath.Join(bin, "shipping")
	migrate := func(dbURL string) {
		cmd := exec.Command(orders, "migrate")
		cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("orders migrate: %v\n%s", err, out)
		}
	}
	migrate(dbURL)

	apiAddr, relayAddr, shippingAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	ordersEnv := []string{"DATABASE_URL=" + dbURL, "AMQP_URL=" + amqpURL}
	startProcess(t, orders, nil, append(ordersEnv, "HTTP_ADDR="+apiAddr))
	startProcess(t, orders, []string{"relay"}, append(ordersEnv, "HTTP_ADDR="+relayAddr))
	// Shipping registers all its metrics at start; MongoDB is not needed
	// for /metrics (the service waits for it), so none is started.
	startProcess(t, shipping, nil, []string{"AMQP_URL=" + amqpURL, "HTTP_ADDR=" + shippingAddr,
		"MONGO_URI=mongodb://" + freeAddr(t) + "/shipping"})

	scrapes := map[string][]string{
		// The API's own, the relay's, and the backlog read from the database.
		// http_server_request_duration_seconds once a request was answered:
		// the scrapes themselves are.
		"http://" + apiAddr + "/metrics":      {"orders_created_total", "outbox_published_total", "outbox_pending", "http_server_request_duration_seconds_count"},
		"http://" + relayAddr + "/metrics":    {"outbox_published_total", "outbox_pending"},
		"http://" + shippingAddr + "/metrics": {"shipping_events_processed_total", "shipping_commit_to_applied_seconds_bucket"},
	}

	// A relay in RELAY_MODE=wal, on a database of its own (a polling relay
	// and a WAL relay must not share an outbox): it exports the slot's
	// metrics.
	walDB := scratchDatabase(t)
	migrate(walDB)
	slot := randomName("metricstest_")
	dropSlotAtCleanup(t, walDB, slot)
	walAddr := freeAddr(t)
	startProcess(t, orders, []string{"relay"}, []string{"DATABASE_URL=" + walDB, "AMQP_URL=" + amqpURL,
		"HTTP_ADDR=" + walAddr, "RELAY_MODE=wal", "RELAY_WAL_SLOT=" + slot})
	scrapes["http://"+walAddr+"/metrics"] = []string{"outbox_wal_slot_lag_bytes", "outbox_wal_relay_active"}

	// The database's view of that relay's slot.
	scrapes[startPostgresExporter(t, walDB)] = []string{"pg_up", "pg_replication_slots_active", "pg_replication_slots_wal_at_risk"}

	// The broker's, aggregated and per queue (as the compose Prometheus
	// scrapes it), with a queue to show and a consumer that acked on it.
	brokerURL, brokerMetrics := privateRabbitMQ(t)
	declareQueue(t, brokerURL, "shipping.order-events")
	consumeAndAck(t, brokerURL, "shipping.order-events")
	scrapes[brokerMetrics+"/metrics"] = []string{"rabbitmq_alarms_memory_used_watermark", "rabbitmq_global_messages_unroutable_returned_total",
		"rabbitmq_process_resident_memory_bytes", "rabbitmq_resident_memory_limit_bytes",
		"rabbitmq_disk_space_available_bytes", "rabbitmq_disk_space_available_limit_bytes"}
	scrapes[brokerMetrics+rabbitQueueFamilies] = []string{"rabbitmq_detailed_queue_messages_ready", "rabbitmq_detailed_queue_consumers",
		"rabbitmq_detailed_queue_messages_unacked", "rabbitmq_detailed_channel_messages_acked_total"}

	known := map[string]bool{}
	for u, want := range scrapes {
		for n := range scrapeNames(t, u, want...) {
			known[n] = true
		}
	}
	return known
}

// declareQueue declares a durable queue on the broker at amqpURL.
func declareQueue(t *testing.T, amqpURL, name string) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
}

// consumeAndAck publishes a message to queue and consumes it with a manual
// ack, on a channel left open until the test ends: the broker counts acks
// per channel and queue only while the channel lives.
func consumeAndAck(t *testing.T, amqpURL, queue string) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{Body: []byte("ack me")}); err != nil {
		t.Fatal(err)
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-deliveries:
		if err := d.Ack(false); err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatalf("no delivery from %s: %v", queue, ctx.Err())
	}
}

// dropSlotAtCleanup checks that the server can run a WAL relay
// (wal_level=logical), and drops the relay's slot and publication when the
// test ends, after the relay stopped (cleanups run last first): a slot left
// behind would keep WAL on the server's disk for ever, and forbids dropping
// its database.
func dropSlotAtCleanup(t *testing.T, dbURL, slot string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	var level string
	err = conn.QueryRow(ctx, "SHOW wal_level").Scan(&level)
	_ = conn.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if level != "logical" {
		skipOrFail(t, "wal_level=%s: RELAY_MODE=wal needs logical (deploy/local/ensure-services.sh sets it)", level)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, dbURL)
		if err != nil {
			t.Errorf("drop slot %s: %v", slot, err)
			return
		}
		defer conn.Close(ctx)
		if err := outboxwal.Drop(ctx, conn, slot, slot); err != nil {
			t.Errorf("drop slot %s: %v", slot, err)
		}
	})
}

// scrapeNames polls a /metrics endpoint until it answers with every name in
// want, and returns the metric names of its text exposition.
func scrapeNames(t *testing.T, u string, want ...string) map[string]bool {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	var last string
	for {
		names, err := scrape(u)
		if err == nil && !slices.ContainsFunc(want, func(w string) bool { return !names[w] }) {
			return names
		}
		if err != nil {
			last = err.Error()
		} else {
			last = fmt.Sprintf("%d names, none of %v yet", len(names), want)
		}
		if time.Now().After(deadline) {
			t.Fatalf("scrape %s: %s", u, last)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func scrape(u string) (map[string]bool, error) {
	names := map[string]bool{}
	err := scrapeLines(u, func(line string) error {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			names[f[2]] = true
			if f[3] == "histogram" || f[3] == "summary" {
				names[f[2]+"_sum"], names[f[2]+"_count"] = true, true
				if f[3] == "histogram" {
					names[f[2]+"_bucket"] = true
				}
			}
			return nil
		}
		if line == "" || strings.HasPrefix(line, "#") {
			return nil
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			names[line[:i]] = true
		}
		return nil
	})
	return names, err
}

// startProcess runs a service binary until the test ends, then stops it
// with SIGINT (both services shut down gracefully on it); its output is
// shown if the test failed.
func startProcess(t *testing.T, path string, args, env []string) {
	t.Helper()
	var out syncBuffer
	cmd := exec.Command(path, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Errorf("%s %v did not stop within 30s of SIGINT", filepath.Base(path), args)
		}
		if t.Failed() {
			t.Logf("%s %v output:\n%s", filepath.Base(path), args, out.String())
		}
	})
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func randomName(prefix string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// skipOrFail skips when a service the test needs is missing, and fails under
// CI=true, where every service must be there.
func skipOrFail(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}

// scratchDatabase names a database that `orders migrate` creates, dropped
// when the test ends.
func scratchDatabase(t *testing.T) string {
	t.Helper()
	base := cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		skipOrFail(t, "PostgreSQL unreachable at %s: %v", base, err)
	}
	_ = conn.Close(ctx)
	name := randomName("orders_metricstest_")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Errorf("drop %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop %s: %v", name, err)
		}
	})
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}

// scratchVhost creates a RabbitMQ vhost of the test's own, deleted when the
// test ends, and returns the AMQP URL that points at it.
func scratchVhost(t *testing.T) string {
	t.Helper()
	u, err := url.Parse(cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		skipOrFail(t, "rabbitmqctl not found (needed to create the test's vhost): %v", err)
	}
	vhost := randomName("metricstest-")
	for _, args := range [][]string{
		{"add_vhost", vhost},
		{"set_permissions", "-p", vhost, u.User.Username(), ".*", ".*", ".*"},
	} {
		if out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput(); err != nil {
			skipOrFail(t, "rabbitmqctl %v: %v: %s", args, err, out)
		}
	}
	t.Cleanup(func() {
		if out, err := exec.Command("rabbitmqctl", "-q", "delete_vhost", vhost).CombinedOutput(); err != nil {
			t.Errorf("delete vhost %s: %v: %s", vhost, err, out)
		}
	})
	u.Path = "/" + vhost
	return u.String()
}

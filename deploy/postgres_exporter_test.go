package deploy_test

import (
	"bufio"
	"context"
	"fmt"
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

	"github.com/jackc/pgx/v5"
)

const exporterQueries = "postgres-exporter/queries.yaml"

// postgresExporter returns the path of postgres_exporter (Debian package
// prometheus-postgres-exporter, which .ci/run installs): the test skips
// without it, and fails under CI=true.
func postgresExporter(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"prometheus-postgres-exporter", "postgres_exporter"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	skipOrFail(t, "postgres_exporter not found: install the Debian package prometheus-postgres-exporter")
	return ""
}

// startPostgresExporter runs postgres_exporter with the compose file's
// queries against dbURL and returns its /metrics URL.
func startPostgresExporter(t *testing.T, dbURL string) string {
	t.Helper()
	queries, err := filepath.Abs(exporterQueries)
	if err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	serverProc(t, "postgres_exporter", nil, syscall.SIGTERM, []string{"DATA_SOURCE_NAME=" + dbURL},
		postgresExporter(t), "--extend.query-path="+queries, "--web.listen-address="+addr,
		"--disable-settings-metrics", "--log.level=warn")
	return "http://" + addr + "/metrics"
}

// sample is one series of a text exposition.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

var (
	sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)`)
	labelPair  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)
)

// scrapeSamples returns the samples of a /metrics endpoint.
func scrapeSamples(u string) ([]sample, error) {
	var out []sample
	err := scrapeLines(u, func(line string) error {
		m := sampleLine.FindStringSubmatch(line)
		if m == nil {
			return nil
		}
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			return fmt.Errorf("%q: %w", line, err)
		}
		s := sample{name: m[1], labels: map[string]string{}, value: v}
		for _, l := range labelPair.FindAllStringSubmatch(m[2], -1) {
			s.labels[l[1]] = l[2]
		}
		out = append(out, s)
		return nil
	})
	return out, err
}

// scrapeLines calls each with every line of a /metrics endpoint's answer.
func scrapeLines(u string, each func(string) error) error {
	resp, err := http.Get(u)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", u, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if err := each(sc.Text()); err != nil {
			return err
		}
	}
	return sc.Err()
}

// slotState is what the exporter says of one replication slot.
type slotState struct {
	walStatus                                              string
	active, retained, confirmedLag, safeWALSize, walAtRisk float64
	series                                                 int
}

// waitSlot scrapes u until ok holds for the slot's state, and returns it.
func waitSlot(t *testing.T, u, slot, what string, ok func(slotState) bool) slotState {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	var last slotState
	var lastErr error
	for {
		samples, err := scrapeSamples(u)
		if err == nil {
			st := slotState{}
			for _, s := range samples {
				if !strings.HasPrefix(s.name, "pg_replication_slots_") || s.labels["slot_name"] != slot {
					continue
				}
				st.series++
				st.walStatus = s.labels["wal_status"]
				switch s.name {
				case "pg_replication_slots_active":
					st.active = s.value
				case "pg_replication_slots_retained_bytes":
					st.retained = s.value
				case "pg_replication_slots_confirmed_lag_bytes":
					st.confirmedLag = s.value
				case "pg_replication_slots_safe_wal_size_bytes":
					st.safeWALSize = s.value
				case "pg_replication_slots_wal_at_risk":
					st.walAtRisk = s.value
				}
			}
			last = st
			if ok(st) {
				return st
			}
		}
		lastErr = err
		if time.Now().After(deadline) {
			t.Fatalf("the exporter never showed %s for slot %s; last: %+v (scrape error %v)", what, slot, last, lastErr)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// The slot as the database sees it, through the real postgres_exporter and
// deploy/postgres-exporter/queries.yaml, on a PostgreSQL server of the
// test's own that may keep only 16 MB of WAL for a slot: the series the
// PostgresReplicationSlot* alerts read follow a slot from idle, to streamed
// from (pg_recvlogical), to abandoned while WAL is written, to unreserved or
// lost, and to lost after a checkpoint, with no relay process involved.
func TestPostgresExporterSeesReplicationSlots(t *testing.T) {
	t.Parallel()
	binDir, dbURL := privatePostgres(t, "max_slot_wal_keep_size=16MB", "max_wal_size=32MB", "min_wal_size=32MB", "wal_keep_size=0")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	const slot = "outbox_exporter_test"
	if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", slot); err != nil {
		t.Fatal(err)
	}
	metrics := startPostgresExporter(t, dbURL)

	st := waitSlot(t, metrics, slot, "an idle slot", func(s slotState) bool { return s.series == 5 && s.walStatus == "reserved" })
	if st.active != 0 || st.walAtRisk != 0 || st.safeWALSize <= 0 {
		t.Errorf("idle slot: %+v, want inactive, not at risk, and a safe WAL size (max_slot_wal_keep_size is set)", st)
	}

	// A consumer streams from the slot.
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	stopRecv := serverProc(t, "pg_recvlogical", nil, syscall.SIGTERM, nil, filepath.Join(binDir, "pg_recvlogical"),
		"-d", fmt.Sprintf("host=127.0.0.1 port=%s user=postgres dbname=postgres", u.Port()), "--slot="+slot, "--start", "-f", os.DevNull)
	waitSlot(t, metrics, slot, "a streamed slot", func(s slotState) bool { return s.active == 1 })
	stopRecv()
	waitSlot(t, metrics, slot, "an abandoned slot", func(s slotState) bool { return s.active == 0 })

	// WAL is written while nobody streams: the slot keeps it, then its
	// WAL is past max_slot_wal_keep_size.
	if _, err := conn.Exec(ctx, "CREATE TABLE fill (x text)"); err != nil {
		t.Fatal(err)
	}
	before := waitSlot(t, metrics, slot, "the slot before the writes", func(slotState) bool { return true }).retained
	for i := 0; i < 5; i++ {
		if _, err := conn.Exec(ctx, "INSERT INTO fill SELECT repeat('x', 1000) FROM generate_series(1, 2000)"); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "SELECT pg_switch_wal()"); err != nil {
			t.Fatal(err)
		}
	}
	st = waitSlot(t, metrics, slot, "a slot at risk", func(s slotState) bool { return s.walAtRisk == 1 })
	if st.walStatus != "unreserved" && st.walStatus != "lost" {
		t.Errorf("slot at risk with wal_status %q, want unreserved or lost", st.walStatus)
	}
	// The consumer acknowledged nothing of those segments either.
	if st.confirmedLag <= 4*16<<20 {
		t.Errorf("slot at risk is %v bytes behind its acknowledged position, want more than the 4 segments written since it was streamed", st.confirmedLag)
	}
	if st.walStatus == "unreserved" && st.retained <= before+16<<20 {
		t.Errorf("unreserved slot retains %v bytes (%v before 5 WAL segments were written)", st.retained, before)
	}
	if _, err := conn.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	st = waitSlot(t, metrics, slot, "a lost slot", func(s slotState) bool { return s.walStatus == "lost" })
	if st.walAtRisk != 1 || st.active != 0 {
		t.Errorf("lost slot: %+v, want at risk and inactive", st)
	}
}

// The slots' query failing (here its role loses EXECUTE on
// pg_wal_lsn_diff) is what PostgresExporterQueryFailing reads: the real
// exporter still reaches the database (pg_up 1) but reports the scrape's
// error (pg_exporter_last_scrape_error 1), and the slot's series are gone,
// as if there were no slot; the grant back ends both.
func TestPostgresExporterReportsAFailingSlotQuery(t *testing.T) {
	t.Parallel()
	_, dbURL := privatePostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	const slot = "outbox_exporter_failing"
	for _, q := range []string{
		"CREATE ROLE exporter LOGIN IN ROLE pg_monitor",
		"SELECT pg_create_logical_replication_slot('" + slot + "', 'test_decoding')",
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User("exporter")
	metrics := startPostgresExporter(t, u.String())

	// wait waits until the exporter's scrape shows want: pg_up, its last
	// scrape error, and whether the slot has series.
	type state struct {
		up, scrapeError float64
		slot            bool
	}
	wait := func(what string, want state) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		var got state
		for {
			samples, err := scrapeSamples(metrics)
			if err == nil {
				got = state{up: -1, scrapeError: -1}
				for _, s := range samples {
					switch {
					case s.name == "pg_up":
						got.up = s.value
					case s.name == "pg_exporter_last_scrape_error":
						got.scrapeError = s.value
					case strings.HasPrefix(s.name, "pg_replication_slots_") && s.labels["slot_name"] == slot:
						got.slot = true
					}
				}
				if got == want {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the exporter shows %+v (error %v), want %+v", what, got, err, want)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	wait("the query works", state{up: 1, scrapeError: 0, slot: true})
	revoke := "REVOKE EXECUTE ON FUNCTION pg_wal_lsn_diff(pg_lsn, pg_lsn) FROM PUBLIC"
	if _, err := conn.Exec(ctx, revoke); err != nil {
		t.Fatal(err)
	}
	wait("the query fails", state{up: 1, scrapeError: 1, slot: false})
	if _, err := conn.Exec(ctx, strings.Replace(strings.Replace(revoke, "REVOKE", "GRANT", 1), "FROM", "TO", 1)); err != nil {
		t.Fatal(err)
	}
	wait("the query works again", state{up: 1, scrapeError: 0, slot: true})
}

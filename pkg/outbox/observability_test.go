package outbox_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// countingMetrics counts what operators alert on.
type countingMetrics struct {
	claimFailures, markFailures, unmarked, listenReconnects atomic.Int64
}

var _ outbox.Observer = (*countingMetrics)(nil)

func (m *countingMetrics) Observe(_ context.Context, o outbox.Observation) {
	switch o.Kind {
	case outbox.KindClaimFailed:
		m.claimFailures.Add(1)
	case outbox.KindMarkFailed:
		m.markFailures.Add(1)
	case outbox.KindUnmarked:
		m.unmarked.Add(int64(o.N))
	case outbox.KindListenReconnected:
		m.listenReconnects.Add(1)
	}
}

// A claim against a table that is not there (a failover to a wrong database,
// a botched migration) counts as a claim failure, and the relay resumes once
// the table is back.
func TestRelayCountsFailedClaims(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]
	if _, err := pool.Exec(ctx, "ALTER TABLE outbox RENAME TO outbox_away"); err != nil {
		t.Fatal(err)
	}
	m := &countingMetrics{}
	cfg := fastConfig(t)
	cfg.Observer = m
	batches := make(chan outboxtest.BatchResult, 10)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	startRelay(t, pool, &memPublisher{}, cfg)
	waitFor(t, "a failed claim counted", 10*time.Second, func() (bool, error) { return m.claimFailures.Load() > 0, nil })

	if _, err := pool.Exec(ctx, "ALTER TABLE outbox_away RENAME TO outbox"); err != nil {
		t.Fatal(err)
	}
	waitPublished(t, batches, e.ID)
}

// A mark that fails (here outbox_published is gone) is counted each time, and
// so is the row the relay gives up marking: it is published again after its
// lease.
func TestRelayCountsFailedMarksAndUnmarkedRows(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]

	m := &countingMetrics{}
	cfg := fastConfig(t)
	cfg.Observer = m
	cfg.Lease = time.Second
	cfg.PublishTimeout = 500 * time.Millisecond
	var once sync.Once
	cfg.Observer = outboxtest.OnConfirmed(cfg.Observer, func([]int64) {
		once.Do(func() {
			if _, err := pool.Exec(ctx, "ALTER TABLE outbox_published RENAME TO outbox_published_away"); err != nil {
				t.Error(err)
			}
		})
	})
	batches := make(chan outboxtest.BatchResult, 10)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	pub := &memPublisher{}
	startRelay(t, pool, pub, cfg)

	select {
	case r := <-batches:
		if !slices.Equal(r.Unmarked, []int64{e.ID}) || r.Err == nil {
			t.Fatalf("batch %+v, want %d unmarked with an error", r, e.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no batch")
	}
	if m.markFailures.Load() == 0 || m.unmarked.Load() != 1 {
		t.Fatalf("mark failures %d, unmarked %d; want at least 1 and 1", m.markFailures.Load(), m.unmarked.Load())
	}
	// The relay knows the row was published: it is not taken for the orphan of
	// a crash, to be retried alone.
	var inFlight bool
	if err := pool.QueryRow(ctx, "SELECT in_flight FROM outbox WHERE id = $1", e.ID).Scan(&inFlight); err != nil {
		t.Fatal(err)
	}
	if inFlight {
		t.Fatal("the unmarked row is still in flight")
	}
	if _, err := pool.Exec(ctx, "ALTER TABLE outbox_published_away RENAME TO outbox_published"); err != nil {
		t.Fatal(err)
	}
	waitPublished(t, batches, e.ID)
	if got := pub.Snapshot(); len(got) != 2 {
		t.Fatalf("published %d times, want 2 (again after the lease)", len(got))
	}
}

// logRecorder keeps the records logged at or above a level.
type logRecorder struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *logRecorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r.Clone())
	return nil
}
func (h *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logRecorder) WithGroup(string) slog.Handler      { return h }

// durations returns the value of key in every record with message msg.
func (h *logRecorder) durations(msg, key string) []time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []time.Duration
	for _, r := range h.records {
		if r.Message != msg {
			continue
		}
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == key {
				out = append(out, a.Value.Duration())
			}
			return true
		})
	}
	return out
}

// appPool returns a pool on pool's schema whose sessions carry a unique
// application_name, so the test can find (and terminate) them.
func appPool(t *testing.T, pool *pgxpool.Pool, host string, port uint16) (*pgxpool.Pool, string) {
	t.Helper()
	app := fmt.Sprintf("outbox_test_%d", time.Now().UnixNano())
	cfg := pool.Config()
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	if host != "" {
		cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, port
		cfg.ConnConfig.Fallbacks = nil
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, app
}

// listenerPID returns the pid of app's LISTEN session started after since, or
// 0, once its LISTEN has completed (state idle): a session terminated while its
// LISTEN still runs is a failed attempt, which rightly grows the backoff.
func listenerPID(ctx context.Context, pool *pgxpool.Pool, app string, since time.Time) (int, error) {
	var pid int
	err := pool.QueryRow(ctx, `
SELECT coalesce(max(pid), 0) FROM pg_stat_activity
WHERE application_name = $1 AND query LIKE 'LISTEN%' AND state = 'idle' AND backend_start > $2`, app, since).Scan(&pid)
	return pid, err
}

// The LISTEN connection's backoff starts over after each successful LISTEN: a
// connection that breaks now and then is reopened at once every time, not
// after a wait that grew with every break since the relay started.
func TestRelayListenBackoffStartsOverAfterASuccessfulListen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := newTestPool(t)
	pool, app := appPool(t, base, "", 0)

	logs := &logRecorder{}
	m := &countingMetrics{}
	cfg := fastConfig(t)
	cfg.Logger = slog.New(logs)
	cfg.Observer = m
	cfg.NotifyChannel = app
	startRelay(t, pool, &memPublisher{}, cfg)

	const breaks = 6
	since := time.Time{}
	for i := range breaks {
		var pid int
		waitFor(t, "relay listening", 20*time.Second, func() (bool, error) {
			var err error
			pid, err = listenerPID(ctx, base, app, since)
			return pid != 0, err
		})
		since = time.Now()
		if _, err := base.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
			t.Fatal(err)
		}
		waitFor(t, fmt.Sprintf("break %d noticed", i+1), 20*time.Second, func() (bool, error) {
			return len(logs.durations("outbox relay: LISTEN connection lost, reconnecting", "retry_in")) == i+1, nil
		})
	}
	waits := logs.durations("outbox relay: LISTEN connection lost, reconnecting", "retry_in")
	for i, w := range waits {
		if w > 100*time.Millisecond {
			t.Fatalf("reconnection %d waited %v, want the first step of the backoff (at most 100ms): %v", i+1, w, waits)
		}
	}
	if n := m.listenReconnects.Load(); n != breaks {
		t.Fatalf("counted %d LISTEN reconnects, want %d", n, breaks)
	}
}

// freezingProxy forwards TCP connections to PostgreSQL. It tells the LISTEN
// connection apart by its bytes, and freeze makes that connection silent in
// both directions without closing it: what a network partition or a firewall
// dropping an idle flow looks like to the relay.
type freezingProxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu     sync.Mutex
	conns  []net.Conn
	frozen map[net.Conn]bool // client side of LISTEN connections, when frozen
	listen map[net.Conn]bool // client side of LISTEN connections
}

func newFreezingProxy(t *testing.T, target string) *freezingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &freezingProxy{ln: ln, target: target, frozen: map[net.Conn]bool{}, listen: map[net.Conn]bool{}}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *freezingProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(c, s, c, true) })
		p.wg.Go(func() { p.pipe(s, c, c, false) })
	}
}

// pipe copies from src to dst; client is the connection's client side.
func (p *freezingProxy) pipe(src, dst, client net.Conn, fromClient bool) {
	defer src.Close()
	defer dst.Close()
	defer func() {
		p.mu.Lock()
		delete(p.listen, client)
		p.mu.Unlock()
	}()
	buf := make([]byte, 32*1024)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			if fromClient && bytes.Contains(buf[:n], []byte("LISTEN ")) {
				p.listen[client] = true
			}
			frozen := p.frozen[client]
			p.mu.Unlock()
			if !frozen {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// freeze silences the LISTEN connections open now and returns how many.
func (p *freezingProxy) freeze() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.listen {
		p.frozen[c] = true
	}
	return len(p.listen)
}

func (p *freezingProxy) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// A LISTEN connection that died without a word (no error, no FIN: a network
// partition) is found by the keepalive and reopened, so notifications wake
// the relay again.
func TestRelayReopensASilentlyDeadListenConnection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := newTestPool(t)
	bc := base.Config().ConnConfig
	proxy := newFreezingProxy(t, net.JoinHostPort(bc.Host, fmt.Sprint(bc.Port)))
	addr := proxy.ln.Addr().(*net.TCPAddr)
	pool, app := appPool(t, base, "127.0.0.1", uint16(addr.Port))

	m := &countingMetrics{}
	cfg := fastConfig(t)
	cfg.PollInterval = time.Hour // only notifications find rows
	cfg.NotifyChannel = app
	cfg.ListenKeepalive = 200 * time.Millisecond
	cfg.Observer = m
	batches := make(chan outboxtest.BatchResult, 10)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	startRelay(t, pool, &memPublisher{}, cfg)
	w, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: app})
	if err != nil {
		t.Fatal(err)
	}
	notifyOne := func(agg string) int64 {
		t.Helper()
		var e []outbox.Enqueued
		err := pgx.BeginFunc(ctx, base, func(tx pgx.Tx) error {
			var err error
			e, err = w.Enqueue(ctx, tx, msg(agg, "order.created"))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return e[0].ID
	}

	waitFor(t, "relay listening", 20*time.Second, func() (bool, error) {
		pid, err := listenerPID(ctx, base, app, time.Time{})
		return pid != 0, err
	})
	waitPublished(t, batches, notifyOne("o-1"))

	if n := proxy.freeze(); n == 0 {
		t.Fatal("no LISTEN connection to freeze")
	}
	frozenAt := time.Now()
	waitFor(t, "relay listening on a new connection", 20*time.Second, func() (bool, error) {
		pid, err := listenerPID(ctx, base, app, frozenAt)
		return pid != 0, err
	})
	waitPublished(t, batches, notifyOne("o-2"))
	if m.listenReconnects.Load() < 1 {
		t.Fatal("the reconnection was not counted")
	}
}

// When the relay gives up marking confirmed rows (here the writer of the
// aggregate's next event holds the row past the lease's margin) and then
// cannot even record that (here a trigger refuses the update), the failed
// statement is counted with the failed marks: it is database trouble too.
func TestRelayCountsAFailedReleaseOfUnmarkedRows(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]

	// The writer of the next event holds the row, as Enqueue does.
	writer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Rollback(ctx) //nolint:errcheck // ends the hold
	if _, err := writer.Exec(ctx, "SELECT 1 FROM outbox WHERE id = $1 FOR KEY SHARE", e.ID); err != nil {
		t.Fatal(err)
	}
	// The release of unmarked rows (in flight -> not) fails.
	if _, err := pool.Exec(ctx, `
CREATE FUNCTION refuse_release() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'planted: release refused'; END $$;
CREATE TRIGGER refuse_release BEFORE UPDATE ON outbox
FOR EACH ROW WHEN (OLD.in_flight AND NOT NEW.in_flight) EXECUTE FUNCTION refuse_release()`); err != nil {
		t.Fatal(err)
	}

	m := &countingMetrics{}
	cfg := fastConfig(t)
	cfg.Observer = m
	cfg.Lease = time.Second
	cfg.PublishTimeout = 500 * time.Millisecond
	batches := make(chan outboxtest.BatchResult, 10)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	startRelay(t, pool, &memPublisher{}, cfg)

	select {
	case r := <-batches:
		if !slices.Equal(r.Unmarked, []int64{e.ID}) || r.Err == nil || !strings.Contains(r.Err.Error(), "release refused") {
			t.Fatalf("batch %+v, want %d unmarked, with the release's error", r, e.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no batch")
	}
	// Deferred marks are no failures: the one failure is the release.
	if got := m.markFailures.Load(); got != 1 {
		t.Fatalf("mark failures %d, want 1 (the failed release)", got)
	}
}

package outboxwal_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// migratedServer is a PostgreSQL server of the test's own with the outbox
// tables in its postgres database.
func migratedServer(t *testing.T, settings ...string) *outboxtest.PGServer {
	t.Helper()
	s := outboxtest.NewPGServer(t, settings...)
	pool := serverPool(t, s.URL("postgres"))
	if err := outbox.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return s
}

func serverPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// twoServers starts servers a and b, where a has far more WAL than b and b's
// event ids start far above a's, and a proxy in front of a.
func twoServers(t *testing.T) (a, b *outboxtest.PGServer, proxy *outboxtest.Proxy) {
	t.Helper()
	a = migratedServer(t)
	b = migratedServer(t)
	b.Exec(t, `ALTER TABLE outbox ALTER COLUMN id RESTART WITH 1000000`) // ids of B's events are not A's
	a.Exec(t, `CREATE TABLE filler AS SELECT g, repeat('x', 1000) AS pad FROM generate_series(1, 20000) g`)
	return a, b, outboxtest.NewTCPProxy(t, a.Addr())
}

// walFromServer is walConfig for a server of the test's own: the slot goes
// with the server, so nothing needs dropping.
func walFromServer(t *testing.T) outboxwal.Config {
	cfg := walConfig(t, outboxtest.Pool(t))
	cfg.Slot, cfg.Publication = "outbox_wal", "outbox_wal"
	return cfg
}

// switchover is a relay switched from server A to server B behind the same
// address, where A has far more WAL than B: the relay streamed from A,
// published an event written there and acknowledged past it, then the proxy
// was switched to B, and the relay now streams from B and has reported its
// position to B a few times. aEnd is A's WAL position after the switch, at
// or past every position the relay acknowledged on A.
type switchover struct {
	b     *outboxtest.PGServer
	pool  *pgxpool.Pool // through the proxy: B's now
	bPool *pgxpool.Pool // B's, directly
	br    *broker
	cfg   outboxwal.Config
	stop  func()
	aEnd  string
}

func switchToB(t *testing.T) *switchover {
	t.Helper()
	ctx := context.Background()
	a, b, proxy := twoServers(t)
	sw := &switchover{b: b, br: newBroker(t, "#"), cfg: walFromServer(t)}
	sw.pool = serverPool(t, "postgres://postgres@"+proxy.Addr()+"/postgres?sslmode=disable")
	var acks atomic.Int64
	sw.cfg.Observer = outboxtest.OnAcknowledged(sw.cfg.Observer, func(uint64) { acks.Add(1) })
	var relay *outboxwal.Relay
	relay, sw.stop = startWAL(t, sw.pool, newPublisherForTest(t, sw.br), sw.cfg)
	waitActive(t, relay)
	onA := enqueue(t, sw.pool, msg("on-a", "order.created"))
	sw.br.waitIDs("the event written on A", onA)
	waitFor(t, "A's slot acknowledged past it", 30*time.Second, slotCaughtUp(t, sw.pool, sw.cfg.Slot))

	proxy.SetUpstream(b.Addr())
	proxy.CutAll()
	sw.bPool = serverPool(t, b.URL("postgres"))
	waitFor(t, "the relay streaming from B", 30*time.Second, func() (bool, error) {
		s, err := outboxwal.Slot(ctx, sw.bPool, sw.cfg.Slot)
		return s.Active, err
	})
	from := acks.Load()
	waitFor(t, "the relay reporting its position to B", 10*time.Second, func() (bool, error) { return acks.Load() >= from+3, nil })
	if err := a.QueryRow(t, "SELECT pg_current_wal_lsn()::text", &sw.aEnd); err != nil {
		t.Fatal(err)
	}
	return sw
}

// below says whether B's WAL is still below A's position after the switch.
func (sw *switchover) below(t *testing.T) bool {
	t.Helper()
	var below bool
	if err := sw.bPool.QueryRow(context.Background(), "SELECT pg_current_wal_lsn() < $1::pg_lsn", sw.aEnd).Scan(&below); err != nil {
		t.Fatal(err)
	}
	return below
}

// A relay that finds itself on another server, whose WAL is behind the
// position it acknowledged on the first (a switchover to a server restored
// or built apart, a blue/green switch), must not carry that position over:
// the new server's slot would then skip every transaction below it at the
// next restart. Here the relay, switched from A to B, has reported its
// position to B a few times: B's slot is not ahead of B's WAL (read from
// pg_replication_slots itself: outboxwal.Slot reports no lag below zero, so
// it cannot show a slot ahead), and events committed on B before and after a
// restart are published.
func TestSwitchToAServerWithLessWALLosesNothing(t *testing.T) {
	ctx := context.Background()
	sw := switchToB(t)
	var (
		ahead     bool
		conf, cur string
	)
	err := sw.bPool.QueryRow(ctx, `
SELECT confirmed_flush_lsn > pg_current_wal_lsn(), confirmed_flush_lsn::text, pg_current_wal_lsn()::text
FROM pg_replication_slots WHERE slot_name = $1`, sw.cfg.Slot).Scan(&ahead, &conf, &cur)
	if err != nil {
		t.Fatal(err)
	}
	if ahead {
		t.Fatalf("B's slot is at %s, ahead of B's WAL at %s: the relay acknowledged to B a position of A's (A's WAL is at %s)", conf, cur, sw.aEnd)
	}
	before := enqueue(t, sw.bPool, msg("on-b", "order.created"))
	sw.br.waitIDs("the event written on B", before)

	sw.stop()
	again, _ := startWAL(t, sw.pool, newPublisherForTest(t, sw.br), sw.cfg)
	waitActive(t, again)
	after := enqueue(t, sw.bPool, msg("on-b", "order.cancelled"))
	sw.br.waitIDs("the event written on B after a restart", after)
}

// A slot ahead of its server's WAL is made again at the next start (see
// ensureSlot), which would publish what a carried-over position skips, but
// only while the slot is still ahead. Once the new server's WAL has passed
// the old server's position, the slot looks like any other: a position of
// A's carried over to B's slot would now skip, at the restart, every event
// committed on B below it. Here the relay, switched from A to B, is stopped;
// an event is written on B (below A's position), B's WAL then grows past
// A's position, and the relay starts again: that event, and one written
// after the restart, are published, and the slot was not made again.
func TestSwitchToAServerWhoseWALThenOvertakesLosesNothing(t *testing.T) {
	sw := switchToB(t)
	sw.stop()
	waitSlotFree(t, sw.bPool, sw.cfg.Slot)

	stopped := enqueue(t, sw.bPool, msg("on-b", "order.created"))
	if !sw.below(t) {
		t.Fatalf("B's WAL is already past A's position %s: the event is not below it", sw.aEnd)
	}
	sw.b.Exec(t, `CREATE TABLE filler (g int, pad text)`)
	for sw.below(t) {
		sw.b.Exec(t, `INSERT INTO filler SELECT g, repeat('x', 1000) FROM generate_series(1, 5000) g`)
	}

	logs := &logRecorder{}
	cfg := sw.cfg
	cfg.Logger = slog.New(logs)
	again, _ := startWAL(t, sw.pool, newPublisherForTest(t, sw.br), cfg)
	waitActive(t, again)
	after := enqueue(t, sw.bPool, msg("on-b", "order.cancelled"))
	sw.br.waitIDs("the event written on B while the relay was stopped, below A's position", stopped)
	sw.br.waitIDs("the event written on B after the restart", after)
	if logs.has("making it again") {
		t.Fatal("the slot was made again: B's WAL did not overtake the slot's position, and the test did not take the path it means to")
	}
}

// The relay's pool and its replication connection can reach different
// servers for a while: connections opened before a switchover stay on the
// old server, the relay's new replication connection reaches the new one.
// A session must not look up, sweep or fence on one server what it streams
// from the other (a row looked up on the old server is "gone", and its event
// would be dropped). Here the pool's connections stay on A while the
// replication connection is cut and reopened to B: the relay closes the
// pool connections that reach A, and the event committed on B is published.
func TestPoolOnTheOldServerDoesNotDecideForTheNewOne(t *testing.T) {
	ctx := context.Background()
	a, b, proxy := twoServers(t)
	pool := serverPool(t, "postgres://postgres@"+proxy.Addr()+"/postgres?sslmode=disable&pool_max_conns=4")
	br := newBroker(t, "#")
	cfg := walFromServer(t)
	relay, _ := startWAL(t, pool, newPublisherForTest(t, br), cfg)
	waitActive(t, relay)
	onA := enqueue(t, pool, msg("on-a", "order.created"), msg("on-a2", "order.created"))
	br.waitIDs("the events written on A", onA)
	waitFor(t, "the outbox swept on A", 30*time.Second, outboxEmpty(pool))

	proxy.SetUpstream(b.Addr()) // the pool's open connections stay on A
	a.Exec(t, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE active`)
	bPool := serverPool(t, b.URL("postgres"))
	onB := enqueue(t, bPool, msg("on-b", "order.created"), msg("on-b2", "order.created"))
	br.waitIDs("the events written on B", onB)
	waitFor(t, "the relay streaming from B", 30*time.Second, func() (bool, error) {
		s, err := outboxwal.Slot(ctx, bPool, cfg.Slot)
		return s.Active, err
	})
}

// logRecorder is a slog handler that keeps every message.
type logRecorder struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Message)
	return nil
}
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) has(part string) bool { return l.count(part) > 0 }

// count counts the messages containing part.
func (l *logRecorder) count(part string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.Contains(m, part) {
			n++
		}
	}
	return n
}

// A slot an operator made (before any relay ran) is used, never dropped:
// dropping it would throw away what it retains. Its stream does not hold
// the rows that were in the outbox when it was made, so the relay hands the
// outbox's rows over to polling before it streams, and they go out before
// the later events of their aggregates.
func TestOperatorsSlotIsUsedAndWhatItMissesIsPublished(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	logs := &logRecorder{}
	cfg.Logger = slog.New(logs)
	old := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
	// The publication first: pgoutput cannot decode, from a slot made before
	// its publication, any transaction committed in between.
	for _, q := range []string{
		`CREATE PUBLICATION ` + cfg.Publication + ` FOR TABLE outbox WITH (publish = 'insert')`,
		`SELECT pg_create_logical_replication_slot('` + cfg.Slot + `', 'pgoutput')`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	later := enqueue(t, pool, msg("a", "order.paid"))
	got := b.waitIDs("the rows older than the slot and the later one", append(old, later...))
	checkAggregateOrder(t, got)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
	if logs.has("making it again") {
		t.Fatal("the relay dropped the operator's slot and made it again")
	}
}

// A slot whose last session streamed from another server (a slot a
// PostgreSQL 17 standby kept in sync, a data directory restored elsewhere)
// may sit past rows that are still in this server's outbox: the other
// server's relay published and deleted them, and the deletes never reached
// this one. The relay hands the outbox's rows over to polling before it
// streams. Here a row is left below the slot's position (the slot advanced
// past it by hand) and the slot's row names another server.
func TestSlotLastUsedOnAnotherServerHandsOverWhatItSkips(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	relay, stop := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	first := enqueue(t, pool, msg("a", "order.created"))
	b.waitIDs("the first event", first)
	stop()
	waitSlotFree(t, pool, cfg.Slot)

	skipped := enqueue(t, pool, msg("b", "order.created"))
	if _, err := pool.Exec(ctx, `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, cfg.Slot); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox_wal_slots SET server = '1/1' WHERE slot_name = $1`, cfg.Slot); err != nil {
		t.Fatal(err)
	}
	again, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, again)
	later := enqueue(t, pool, msg("b", "order.paid"))
	got := b.waitIDs("the row below the slot's position and the later one", append(skipped, later...))
	checkAggregateOrder(t, got)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
}

// pausablePublisher answers "not sent" while paused, and otherwise passes
// batches to the real publisher.
type pausablePublisher struct {
	outbox.Publisher
	paused atomic.Bool
}

func (p *pausablePublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	if p.paused.Load() {
		errs := make([]error, len(msgs))
		for i := range errs {
			errs[i] = outbox.ErrNotSent
		}
		return errs
	}
	return p.Publisher.PublishBatch(ctx, msgs)
}

// A failover to a streaming standby while the relay runs: the events the
// standby has that were not published yet (here held back when the primary
// died) go out from the promoted server, before the later events of their
// aggregates, and so do events written after the failover. PostgreSQL 15
// keeps no logical slot on a standby: the relay makes one on the promoted
// server and hands over what its outbox holds.
func TestFailoverToAPromotedStandbyLosesNothing(t *testing.T) {
	ctx := context.Background()
	primary := migratedServer(t)
	standby := primary.NewStandby(t, "s1")
	proxy := outboxtest.NewTCPProxy(t, primary.Addr())
	pool := serverPool(t, "postgres://postgres@"+proxy.Addr()+"/postgres?sslmode=disable")
	br := newBroker(t, "#")
	pub := &pausablePublisher{Publisher: newPublisherForTest(t, br)}
	relay, _ := startWAL(t, pool, pub, walFromServer(t))
	waitActive(t, relay)

	published := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
	br.waitIDs("the events published before the failover", published)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
	pub.paused.Store(true)
	held := enqueue(t, pool, msg("a", "order.paid"), msg("c", "order.created"))
	primaryPool := serverPool(t, primary.URL("postgres"))
	waitFor(t, "the standby replaying everything", 30*time.Second, func() (bool, error) {
		var caughtUp bool
		err := primaryPool.QueryRow(ctx, `SELECT replay_lsn >= pg_current_wal_lsn() FROM pg_stat_replication WHERE application_name = 's1'`).Scan(&caughtUp)
		return caughtUp, err
	})

	primary.Stop(t, "immediate")
	standby.Promote(t)
	proxy.SetUpstream(standby.Addr())
	proxy.CutAll()
	pub.paused.Store(false)
	promoted := serverPool(t, standby.URL("postgres"))
	after := enqueue(t, promoted, msg("a", "order.shipped"), msg("d", "order.created"))
	got := br.waitIDs("the held events and those written after the failover", append(held, after...))
	checkAggregateOrder(t, got)
	waitFor(t, "the promoted server's outbox swept", 30*time.Second, outboxEmpty(promoted))
}

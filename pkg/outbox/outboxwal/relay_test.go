package outboxwal_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// Events written by Enqueue reach the queue through the WAL relay, their rows
// leave the outbox, and the slot is acknowledged past them.
func TestPublishesConfirmsSweepsAndAcknowledges(t *testing.T) {
	for _, archive := range []bool{false, true} {
		t.Run(fmt.Sprintf("archive=%v", archive), func(t *testing.T) {
			ctx := context.Background()
			pool := walPool(t)
			b := newBroker(t, "#")
			cfg := walConfig(t, pool)
			cfg.Archive = archive
			relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
			waitActive(t, relay)

			var want []outbox.Enqueued
			for i := range 20 {
				want = append(want, enqueue(t, pool, msg(fmt.Sprintf("o-%d", i%5), "order.created"),
					msg(fmt.Sprintf("p-%d", i), "order.created"))...)
			}
			got := b.waitIDs("every event", want)
			checkAggregateOrder(t, got)
			checkMessageIDs(t, want, got)
			for _, d := range got {
				if d.Headers["traceparent"] == nil || len(d.Body) == 0 {
					t.Fatalf("delivery %s lacks its header or payload: %v %q", d.MessageId, d.Headers, d.Body)
				}
			}
			waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
			waitFor(t, "the slot acknowledged", 30*time.Second, slotCaughtUp(t, pool, cfg.Slot))
			wantArchived := 0
			if archive {
				wantArchived = len(want)
			}
			if n := count(t, pool, "SELECT count(*) FROM outbox_published"); n != wantArchived {
				t.Fatalf("outbox_published has %d rows, want %d", n, wantArchived)
			}
			st, err := outboxadmin.New(pool).Status(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st.Pending != 0 || st.DeadLettered != 0 {
				t.Fatalf("status %+v, want nothing pending", st)
			}
			s, err := outboxwal.Slot(ctx, pool, cfg.Slot)
			if err != nil || !s.Exists || !s.Active {
				t.Fatalf("slot status %+v, %v: want an active slot", s, err)
			}
		})
	}
}

func newPublisherForTest(t testing.TB, b *broker) outbox.Publisher {
	return newPublisher(t, testAMQPURL(), b.Exchange)
}

// Rows in the outbox before the slot existed are not in its stream: the relay
// hands them over to polling when it creates the slot, and the later events of
// their aggregates wait behind them.
func TestRowsOlderThanTheSlotArePublishedFirst(t *testing.T) {
	pool := walPool(t)
	b := newBroker(t, "#")
	old := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
	cfg := walConfig(t, pool)
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	later := enqueue(t, pool, msg("a", "order.paid"), msg("c", "order.created"))
	got := b.waitIDs("old and new events", append(old, later...))
	checkAggregateOrder(t, got)
	checkMessageIDs(t, append(old, later...), got) // handed over, then streamed
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
}

// A relay stopped with events unpublished, and events written while no relay
// runs, are published by the next relay on the slot.
func TestRestartResumesFromTheSlot(t *testing.T) {
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	pub := newPublisherForTest(t, b)
	relay, stop := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)
	first := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
	b.waitIDs("the first events", first)
	stop()

	var while []outbox.Enqueued
	for i := range 30 {
		while = append(while, enqueue(t, pool, msg(fmt.Sprintf("o-%d", i%3), "order.created"))...)
	}
	relay2, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay2)
	after := enqueue(t, pool, msg("a", "order.paid"))
	got := b.waitIDs("the events written while no relay ran", append(while, after...))
	checkAggregateOrder(t, got)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
}

// The replication connection is cut (its backend terminated) right after the
// broker confirmed a batch, before the relay swept and acknowledged it: the
// relay reconnects, resumes from the slot, and nothing is lost. Events it
// swept before the cut are not published again; the others may be.
func TestReplicationCutAfterConfirmLosesNothing(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	var once sync.Once
	cut := make(chan struct{})
	cfg.Observer = outboxtest.OnConfirmed(cfg.Observer, func([]int64) {
		once.Do(func() {
			if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1`, cfg.Slot); err != nil {
				t.Errorf("terminate the walsender: %v", err)
			}
			close(cut)
		})
	})
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	var want []outbox.Enqueued
	for i := range 40 {
		want = append(want, enqueue(t, pool, msg(fmt.Sprintf("o-%d", i%4), "order.created"))...)
	}
	<-cut
	more := enqueue(t, pool, msg("o-1", "order.paid"))
	got := b.waitIDs("every event after the cut", append(want, more...))
	checkAggregateOrder(t, got)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
	waitFor(t, "the slot acknowledged", 30*time.Second, slotCaughtUp(t, pool, cfg.Slot))
}

// While the broker is unreachable nothing is acknowledged past the events it
// did not confirm; once it is back, everything is published.
func TestBrokerOutage(t *testing.T) {
	pool := walPool(t)
	b := newBroker(t, "#")
	p := newProxy(t)
	cfg := walConfig(t, pool)
	relay, _ := startWAL(t, pool, newPublisher(t, p.URL(t), b.Exchange), cfg)
	waitActive(t, relay)
	first := enqueue(t, pool, msg("a", "order.created"))
	b.waitIDs("the first event", first)
	// Delivered is not yet swept: the row goes once the confirm is handled.
	waitFor(t, "the first event swept", 30*time.Second, outboxEmpty(pool))

	p.Stop()
	var during []outbox.Enqueued
	for i := range 20 {
		during = append(during, enqueue(t, pool, msg(fmt.Sprintf("o-%d", i%4), "order.created"))...)
	}
	waitFor(t, "the relay holding the events", 30*time.Second, func() (bool, error) {
		return relay.Stats().InMemory == len(during), nil
	})
	if n := count(t, pool, "SELECT count(*) FROM outbox"); n != len(during) {
		t.Fatalf("%d rows in the outbox during the outage, want %d", n, len(during))
	}
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	got := b.waitIDs("the events written during the outage", during)
	checkAggregateOrder(t, got)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
	waitFor(t, "the slot acknowledged", 30*time.Second, slotCaughtUp(t, pool, cfg.Slot))
}

// Concurrent writers of shared aggregates: every aggregate's events arrive in
// version order, none missing.
func TestOrderPerAggregateWithConcurrentWriters(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	cfg.Workers = 4
	cfg.BatchSize = 5
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)

	var (
		mu   sync.Mutex
		want []outbox.Enqueued
		wg   sync.WaitGroup
	)
	for w := range 6 {
		wg.Go(func() {
			for i := range 25 {
				agg := fmt.Sprintf("agg-%d", rand.N(5))
				var out []outbox.Enqueued
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					var err error
					out, err = new(outbox.Writer).Enqueue(ctx, tx, msg(agg, "order.updated"), msg(fmt.Sprintf("w%d-%d", w, i), "order.created"))
					return err
				})
				if err != nil {
					t.Errorf("enqueue: %v", err)
					return
				}
				mu.Lock()
				want = append(want, out...)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	got := b.waitIDs("every event", want)
	versions := checkAggregateOrder(t, got)
	var total int64
	for i := range 5 {
		total += versions[fmt.Sprintf("agg-%d", i)]
	}
	if total != 150 {
		t.Fatalf("the shared aggregates got %d distinct versions, want 150", total)
	}
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
}

// An event the broker keeps refusing (unroutable) is dead-lettered in
// PostgreSQL, visible to Admin; the later events of its aggregate are held
// back behind it while other aggregates flow; Admin.Retry (once the cause is
// fixed) gets it and the held events published in order, and the aggregate's
// later events flow from the stream again. Admin.Discard of another dead
// letter releases its aggregate without ever delivering it.
func TestDeadLetterHoldsBackItsAggregateUntilRetryOrDiscard(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "order.#")
	cfg := walConfig(t, pool)
	cfg.MaxAttempts = 3
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	admin := outboxadmin.New(pool)

	bad := func(agg string) outbox.Message { return msg(agg, "bad.event") } // no binding: unroutable
	first := enqueue(t, pool, msg("p", "order.created"), msg("d", "order.created"))
	poisonP := enqueue(t, pool, bad("p"))
	poisonD := enqueue(t, pool, bad("d"))
	heldP := enqueue(t, pool, msg("p", "order.paid"), msg("p", "order.shipped"))
	heldD := enqueue(t, pool, msg("d", "order.paid"))
	others := enqueue(t, pool, msg("x", "order.created"), msg("y", "order.created"))
	b.waitIDs("the first and the other aggregates' events", append(first, others...))

	waitFor(t, "two dead letters", 30*time.Second, func() (bool, error) {
		dl, err := admin.DeadLetters(ctx, 0, 10)
		return len(dl) == 2, err
	})
	// The held events may have gone out once already, early, in the run of
	// the poison's first attempt (see the package doc, "Order per
	// aggregate"); none goes out again while its aggregate is held.
	early := receivedIDs(b.Deliveries())
	dl, err := admin.DeadLetters(ctx, 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if dl[0].ID != poisonP[0].ID || dl[1].ID != poisonD[0].ID || dl[0].Attempts != 3 || dl[0].LastError == "" {
		t.Fatalf("dead letters %+v, want events %d and %d after 3 attempts", dl, poisonP[0].ID, poisonD[0].ID)
	}
	// Later events of the two aggregates keep coming from the stream: held too.
	heldP = append(heldP, enqueue(t, pool, msg("p", "order.closed"))...)
	more := enqueue(t, pool, msg("x", "order.paid"))
	b.waitIDs("other aggregates still flowing", more)
	waitFor(t, "the held events parked", 30*time.Second, func() (bool, error) {
		st, err := admin.Status(ctx)
		return st.Pending == int64(len(heldP)+len(heldD)) && st.DeadLettered == 2, err
	})
	seen := receivedIDs(b.Deliveries())
	for _, e := range append(append(append(poisonP, poisonD...), heldP...), heldD...) {
		if seen[e.ID] > early[e.ID] {
			t.Fatalf("event %d was delivered while its aggregate is held", e.ID)
		}
	}

	b.Bind("bad.#")
	if err := admin.Retry(ctx, poisonP[0].ID); err != nil {
		t.Fatal(err)
	}
	if err := admin.Discard(ctx, poisonD[0].ID, "never valid"); err != nil {
		t.Fatal(err)
	}
	got := b.waitIDs("the retried dead letter and the events held back", append(append(poisonP, heldP...), heldD...))
	discarded := map[string]int64{"d": poisonD[0].AggregateVersion}
	checkLastCopiesInOrder(t, got, discarded)
	if receivedIDs(got)[poisonD[0].ID] > 0 {
		t.Fatalf("the discarded event was delivered")
	}
	// Once the hand-over drained, the aggregates are released: new events go
	// out from the stream, after the held ones.
	after := enqueue(t, pool, msg("p", "order.archived"), msg("d", "order.shipped"))
	got = b.waitIDs("events written after the release", after)
	checkLastCopiesInOrder(t, got, discarded)
	waitFor(t, "the outbox empty", 30*time.Second, outboxEmpty(pool))
	waitFor(t, "the slot acknowledged", 30*time.Second, slotCaughtUp(t, pool, cfg.Slot))
	if n := count(t, pool, "SELECT count(*) FROM outbox_discarded"); n != 1 {
		t.Fatalf("%d discarded rows, want 1", n)
	}
}

// A second relay on the same slot waits while the first streams, and takes
// over when the first stops; nothing is lost meanwhile.
func TestSecondRelayTakesOver(t *testing.T) {
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	pub := newPublisherForTest(t, b)
	first, stopFirst := startWAL(t, pool, pub, cfg)
	waitActive(t, first)
	second, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)

	one := enqueue(t, pool, msg("a", "order.created"))
	b.waitIDs("an event through the first relay", one)
	// The second keeps trying for a while and does not get the slot.
	time.Sleep(5 * cfg.TakeoverInterval)
	if second.Stats().Active {
		t.Fatal("two relays stream from one slot")
	}
	stopFirst()
	two := enqueue(t, pool, msg("a", "order.paid"), msg("b", "order.created"))
	waitActive(t, second)
	got := b.waitIDs("events through the second relay", two)
	checkAggregateOrder(t, got)
	if first.Stats().Active {
		t.Fatal("the stopped relay still says it streams")
	}
}

// A relay whose replication connection is killed (the walsender terminated,
// as when its host dies) loses the slot; another relay waiting takes it.
func TestTakeoverAfterTheActiveRelayLosesItsConnection(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	first, stopFirst := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, first)
	second, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	time.Sleep(3 * cfg.TakeoverInterval)

	// Both now race for the slot: one of them gets it, and events flow.
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1`, cfg.Slot); err != nil {
		t.Fatal(err)
	}
	stopFirst()
	want := enqueue(t, pool, msg("a", "order.created"))
	waitActive(t, second)
	b.waitIDs("the event through the relay that took over", want)
}

func TestConfigRejectsBadValues(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pub := newPublisher(t, testAMQPURL(), "unused")
	for name, cfg := range map[string]outboxwal.Config{
		"slot name":   {Slot: "Bad-Name"},
		"negative":    {Workers: -1},
		"memory":      {BatchSize: 500, MaxInMemory: 10},
		"status":      {StatusInterval: time.Minute},
		"publication": {Publication: "x;drop"},
	} {
		if _, err := outboxwal.NewRelay(pool, pub, cfg); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := outboxwal.NewRelay(pool, pub, outboxwal.Config{}); err != nil {
		t.Errorf("defaults: %v", err)
	}
	if _, err := outboxwal.NewRelay(nil, pub, outboxwal.Config{}); err == nil {
		t.Errorf("nil pool: no error")
	}
}

// A slot whose creator stopped before handing over the rows older than it
// (the publication still says a relay is creating it) is dropped and made
// again, so those rows are still published, before the later events of
// their aggregates.
func TestHalfMadeSlotIsMadeAgain(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	old := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
	for _, q := range []string{
		`CREATE PUBLICATION ` + cfg.Publication + ` FOR TABLE outbox WITH (publish = 'insert')`,
		`COMMENT ON PUBLICATION ` + cfg.Publication + ` IS 'outboxwal: slot ` + cfg.Slot + ` creating'`,
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
}

// A relay waiting for the slot keeps its publisher connected, so that its
// readiness reports the broker and a takeover needs no dial.
func TestWaitingRelayKeepsItsPublisherConnected(t *testing.T) {
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	first, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, first)
	pub := newPublisher(t, testAMQPURL(), b.Exchange)
	second, _ := startWAL(t, pool, pub, cfg)
	waitFor(t, "the waiting relay's publisher connected", 30*time.Second, func() (bool, error) {
		return pub.Ready() == nil, nil
	})
	if second.Stats().Active {
		t.Fatal("two relays stream from one slot")
	}
}

// A confirmed row that the writer of its aggregate's next event holds (FOR
// KEY SHARE, until that writer commits) is skipped by the sweep, not waited
// for, and swept once the writer is done; the next event follows.
func TestSweepSkipsARowAWriterHolds(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	cfg.SweepInterval = time.Second
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)

	first := enqueue(t, pool, msg("a", "order.created"))
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	second, err := new(outbox.Writer).Enqueue(ctx, tx, msg("a", "order.paid"))
	if err != nil {
		t.Fatal(err)
	}
	held := count(t, pool, "SELECT count(*) FROM outbox WHERE id = $1", first[0].ID) == 1
	b.waitIDs("the first event", first)
	time.Sleep(3 * cfg.SweepInterval) // sweeps run meanwhile, and must leave the held row
	if held && count(t, pool, "SELECT count(*) FROM outbox WHERE id = $1", first[0].ID) != 1 {
		t.Fatal("the sweep removed a row a writer holds")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	got := b.waitIDs("the second event", second)
	checkAggregateOrder(t, got)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
	waitFor(t, "the slot acknowledged", 30*time.Second, slotCaughtUp(t, pool, cfg.Slot))
	if !held {
		t.Log("the first row was swept before the writer could hold it: the skip was not exercised")
	}
}

// With VacuumEvery set, the relay vacuums the outbox table after that many
// rows swept (on a server without autovacuum, auto mode does it every 5,000).
func TestRelayVacuumsTheOutboxAfterSweeps(t *testing.T) {
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	cfg.VacuumEvery = 10
	cfg.Poll.VacuumEvery = -1 // the polling relay inside would vacuum at its start on a server without autovacuum
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	var want []outbox.Enqueued
	for i := range 30 {
		want = append(want, enqueue(t, pool, msg(fmt.Sprintf("o-%d", i), "order.created"))...)
	}
	b.waitIDs("every event", want)
	waitFor(t, "a vacuum of the outbox table", 30*time.Second, func() (bool, error) {
		var n int64
		err := pool.QueryRow(context.Background(),
			`SELECT coalesce(vacuum_count, 0) FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).Scan(&n)
		return n > 0, err
	})
}

// A relay waiting for the slot looks at the slot through its pool; it opens
// a replication connection (a WAL sender process on the server) only when
// the slot is free. It used to open one every TakeoverInterval.
func TestWaitingRelayOpensNoReplicationConnectionWhileTheSlotIsBusy(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	active, _ := startWAL(t, pool, &gatePublisher{}, cfg)
	waitActive(t, active)

	pc := pool.Config().Copy()
	proxy := outboxtest.NewTCPProxy(t, fmt.Sprintf("%s:%d", pc.ConnConfig.Host, pc.ConnConfig.Port))
	host, port, _ := strings.Cut(proxy.Addr(), ":")
	pc.ConnConfig.Host = host
	p, _ := strconv.Atoi(port)
	pc.ConnConfig.Port = uint16(p)
	waitingPool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(waitingPool.Close)
	logs := &logRecorder{}
	wcfg := cfg
	wcfg.Logger = slog.New(logs)
	startWAL(t, waitingPool, &gatePublisher{}, wcfg)
	waitFor(t, "the second relay waiting", 10*time.Second, func() (bool, error) { return logs.has("waiting to take over"), nil })
	from := proxy.Accepted()
	time.Sleep(20 * cfg.TakeoverInterval)
	if n := proxy.Accepted() - from; n > 1 {
		t.Fatalf("the waiting relay opened %d connections in %v", n, 20*cfg.TakeoverInterval)
	}
}

// A slot made ahead of the first relay with Prepare, the documented
// deployment step, is one the relay can vouch for: it was made on this
// server and every row older than it was handed over when it was made. The
// events written after it are streamed, not handed over to polling as if the
// slot came from another server.
func TestPreparedSlotIsStreamedNotHandedOver(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	prep, err := outboxwal.NewRelay(pool, newPublisherForTest(t, b), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := prep.Prepare(ctx); err != nil {
		t.Fatal(err)
	}
	want := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"), msg("a", "order.paid"))
	// Rows the stream's events confirmed are swept by the WAL relay; rows
	// handed over are moved by its polling relay, and not counted here.
	var swept atomic.Int64
	cfg.Observer = outboxtest.On(cfg.Observer, outboxwal.KindSwept, func(o outbox.Observation) { swept.Add(int64(o.N)) })
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	checkAggregateOrder(t, b.waitIDs("the events written after Prepare", want))
	waitFor(t, "the outbox emptied", 30*time.Second, outboxEmpty(pool))
	// The sweep's observation follows its commit: the outbox can be empty a
	// moment before the last one is counted.
	deadline := time.Now().Add(10 * time.Second)
	for swept.Load() < int64(len(want)) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := swept.Load(); n != int64(len(want)) {
		t.Errorf("the WAL relay swept %d rows, want %d: the others were handed over to polling", n, len(want))
	}
}

// The stream's reads are bounded by the socket's deadline, set once per
// status interval, not by a context per message: the end of Run's context
// must still end a read at once, not at the next status report.
func TestStopsAtOnceWhileWaitingOnItsStream(t *testing.T) {
	t.Parallel()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	cfg.StatusInterval = outboxwal.MaxStatusInterval
	relay, stop := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	want := enqueue(t, pool, msg("o-1", "order.created"))
	b.waitIDs("the event", want)
	time.Sleep(500 * time.Millisecond) // the stream idle, a read pending until the next status

	start := time.Now()
	stop() // fails the test if Run errs or takes 30s
	if took := time.Since(start); took > 3*time.Second {
		t.Fatalf("Run returned %v after its context ended: the read waited for the status interval", took)
	}
}

package outboxamqp_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// checkAggregateOrder fails the test unless, on the queue, every aggregate's
// versions first appear in order 1, 2, 3... Redeliveries of a version already
// seen are allowed (at-least-once); a version before its predecessor is not.
// It returns how many distinct versions each aggregate got.
func checkAggregateOrder(t testing.TB, ds []amqp.Delivery) map[string]int64 {
	t.Helper()
	last := map[string]int64{}
	for _, d := range ds {
		agg, _ := d.Headers["aggregate_id"].(string)
		v, _ := d.Headers["aggregate_version"].(int64)
		switch {
		case v <= last[agg]: // duplicate of a version already delivered
		case v == last[agg]+1:
			last[agg] = v
		default:
			t.Fatalf("aggregate %s: version %d delivered before version %d", agg, v, last[agg]+1)
		}
	}
	return last
}

func allReceived(want []outbox.Enqueued) func([]amqp.Delivery) bool {
	return func(ds []amqp.Delivery) bool {
		got := receivedIDs(ds)
		for _, e := range want {
			if got[e.ID] == 0 {
				return false
			}
		}
		return true
	}
}

// ids come from one sequence, but a row that commits after rows with larger ids
// were published is still published: pending is a state, not an id range.
func TestRelayPublishesARowCommittedAfterLaterRowsWerePublished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestPool(t)
	b := newBroker(t, true)
	pub := newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil))

	late, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx) //nolint:errcheck
	lateIDs, err := new(outbox.Writer).Enqueue(ctx, late, msg("late", "order.created"))
	if err != nil {
		t.Fatal(err)
	}

	relay := startRelay(t, pool, pub, relayConfig(t))
	early := enqueue(t, pool, msg("o-1", "order.created"), msg("o-2", "order.created"))
	relay.Wake()
	b.WaitDeliveries("the early rows", 10*time.Second, allReceived(early))
	waitFor(t, "early rows marked", 10*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published").Scan(&n)
		return n == 2, err
	})
	if lateIDs[0].ID > early[0].ID {
		t.Fatalf("late row id %d should be smaller than the early rows' (%d)", lateIDs[0].ID, early[0].ID)
	}

	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	relay.Wake()
	b.WaitDeliveries("the late row", 10*time.Second, allReceived(lateIDs))
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	checkMarkedWereReceived(t, pool, b)
}

// A message no queue receives is returned by the broker: it is a failed
// attempt, never marked published, dead-lettered after MaxAttempts; once a
// queue exists, an operator retry publishes it and the event behind it.
func TestRelayNeverMarksAnUnroutableMessageThenRetriesADeadLetter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestPool(t)
	b := newBroker(t, false)
	pub := newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil))
	admin := outboxadmin.New(pool)

	cfg := relayConfig(t)
	cfg.MaxAttempts = 3
	dead := make(chan int64, 1)
	var published atomic.Int64
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		published.Add(int64(len(r.Published)))
		for _, id := range r.DeadLettered {
			dead <- id
		}
	})
	startRelay(t, pool, pub, cfg)
	events := enqueue(t, pool, msg("o-1", "order.created"), msg("o-1", "order.cancelled"))

	select {
	case id := <-dead:
		if id != events[0].ID {
			t.Fatalf("dead-lettered %d, want %d", id, events[0].ID)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("unroutable event never dead-lettered")
	}
	if n := published.Load(); n != 0 || len(publishedIDs(t, pool)) != 0 {
		t.Fatalf("%d unroutable events marked published", n)
	}
	dls, err := admin.DeadLetters(ctx, 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 || dls[0].Attempts != 3 || !strings.Contains(dls[0].LastError, "NO_ROUTE") {
		t.Fatalf("dead letters = %+v, want event %d after 3 attempts, returned NO_ROUTE", dls, events[0].ID)
	}

	b.bind("#", nil)
	if n, err := admin.RetryAll(ctx); err != nil || n != 1 {
		t.Fatalf("RetryAll = %d, %v; want 1", n, err)
	}
	ds := b.WaitDeliveries("both events", 10*time.Second, allReceived(events))
	if last := checkAggregateOrder(t, ds); last["o-1"] != 2 {
		t.Fatalf("aggregate o-1 reached version %d, want 2", last["o-1"])
	}
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	checkMarkedWereReceived(t, pool, b)
}

// The broker is unreachable when the relay starts: Run keeps going, claims
// nothing (no batch, no attempt: a claim whose publish is not sent gives its
// attempt back, so the attempts column alone would not show it), and the
// backlog drains once the broker is back.
func TestRelayDrainsAfterTheBrokerWasDownAtStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestPool(t)
	b := newBroker(t, true)
	px := newProxy(t)
	url := px.URL(t)
	px.Stop() // the broker is "down": nothing listens on the publisher's address

	var connectFailures atomic.Int64
	failed := make(chan struct{})
	log := testLogger(t, func(m string) {
		if strings.Contains(m, "connect failed") && connectFailures.Add(1) == 5 {
			close(failed)
		}
	})
	pub := newPublisher(t, url, b.Exchange, log)
	var msgs []outbox.Message
	for i := range 300 {
		msgs = append(msgs, msg(fmt.Sprintf("o-%d", i%50), "order.touched"))
	}
	events := enqueue(t, pool, msgs...)
	cfg := relayConfig(t)
	var batches atomic.Int64
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(outboxtest.BatchResult) { batches.Add(1) })
	startRelay(t, pool, pub, cfg)

	select {
	case <-failed:
	case <-time.After(10 * time.Second):
		t.Fatal("the publisher did not try to connect")
	}
	if n := batches.Load(); n != 0 {
		t.Fatalf("%d batches claimed while the broker was unreachable, want none", n)
	}
	var pending, attempts int
	if err := pool.QueryRow(ctx, "SELECT count(*), coalesce(sum(attempts), 0) FROM outbox").Scan(&pending, &attempts); err != nil {
		t.Fatal(err)
	}
	if pending != len(events) || attempts != 0 {
		t.Fatalf("during the outage: %d pending with %d attempts spent, want %d and 0", pending, attempts, len(events))
	}

	if err := px.Start(); err != nil {
		t.Fatalf("restart proxy: %v", err)
	}
	ds := b.WaitDeliveries("every event", 30*time.Second, allReceived(events))
	checkAggregateOrder(t, ds)
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	checkMarkedWereReceived(t, pool, b)
	if err := pool.QueryRow(ctx, "SELECT max(attempts) FROM outbox_published").Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != 1 {
		t.Fatalf("an event took %d attempts, want 1: the outage must not cost attempts", attempts)
	}
}

// cutter wraps the publisher: on its armed batch it drops the broker's replies
// (so confirms never arrive), waits until the broker has routed every message
// of the batch, then cuts the connection. The batch's outcome is then unknown
// to the relay.
type cutter struct {
	outbox.Publisher
	t      testing.TB
	px     *outboxtest.Proxy
	b      *broker
	armed  atomic.Bool
	cutErr chan []error
}

func (c *cutter) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	if !c.armed.CompareAndSwap(true, false) {
		return c.Publisher.PublishBatch(ctx, msgs)
	}
	c.px.DropReplies(true)
	routed := make(chan struct{})
	go func() {
		defer close(routed)
		want := map[string]bool{}
		for _, m := range msgs {
			want[m.MessageID()] = true
		}
		c.b.WaitDeliveries("the cut batch routed", 10*time.Second, func(ds []amqp.Delivery) bool {
			n := 0
			for _, d := range ds {
				if want[d.MessageId] {
					n++
					delete(want, d.MessageId)
				}
			}
			return len(want) == 0
		})
		c.px.Stop() // cut every connection through the proxy
		c.px.DropReplies(false)
		if err := c.px.Start(); err != nil {
			c.t.Errorf("restart proxy: %v", err)
		}
	}()
	errs := c.Publisher.PublishBatch(ctx, msgs)
	<-routed
	c.cutErr <- errs
	return errs
}

// The connection drops after the broker stored a batch and before its
// confirms arrive: nothing of that batch is marked, everything is published
// again after reconnecting (duplicates, never a loss), and no row is marked
// that the queue did not receive.
func TestRelayConnectionCutMidBatchMarksNothingUnconfirmed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestPool(t)
	b := newBroker(t, true)
	px := newProxy(t)
	pub := newPublisher(t, px.URL(t), b.Exchange, testLogger(t, nil))

	c := &cutter{Publisher: pub, t: t, px: px, b: b, cutErr: make(chan []error, 1)}
	var cutBatch atomic.Pointer[outboxtest.BatchResult]
	cfg := relayConfig(t)
	cfg.Workers = 1
	cfg.BatchSize = 100
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		if len(r.Failed) > 0 && cutBatch.Load() == nil {
			cutBatch.Store(&r)
		}
	})
	relay := startRelay(t, pool, c, cfg)

	var msgs []outbox.Message
	for i := range 1000 {
		msgs = append(msgs, msg(fmt.Sprintf("o-%d", i%250), "order.touched"))
	}
	first := enqueue(t, pool, msgs[:10]...)
	relay.Wake()
	b.WaitDeliveries("the connection up", 10*time.Second, allReceived(first))
	c.armed.Store(true)
	rest := enqueue(t, pool, msgs[10:]...)
	relay.Wake()

	var errs []error
	select {
	case errs = <-c.cutErr:
	case <-time.After(20 * time.Second):
		t.Fatal("the cut batch never ran")
	}
	for i, err := range errs {
		if err == nil {
			t.Fatalf("message %d of the cut batch reported confirmed", i)
		}
		if errors.Is(err, outbox.ErrNotSent) {
			t.Fatalf("message %d of the cut batch reported not sent, though the broker routed it: %v", i, err)
		}
	}

	all := append(first, rest...)
	ds := b.WaitDeliveries("every event", 30*time.Second, allReceived(all))
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	checkAggregateOrder(t, b.Deliveries())
	checkMarkedWereReceived(t, pool, b)

	r := cutBatch.Load()
	if r == nil || len(r.Published) != 0 || len(r.Failed) != len(errs) {
		t.Fatalf("cut batch result = %+v, want all %d failed and none published", r, len(errs))
	}
	dups := 0
	for _, n := range receivedIDs(ds) {
		if n > 1 {
			dups++
		}
	}
	if dups == 0 {
		t.Fatal("no event was delivered twice: the cut batch was not published again")
	}
	var attempts int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published WHERE attempts = 2").Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != len(errs) {
		t.Fatalf("%d events published at their second attempt, want the %d of the cut batch", attempts, len(errs))
	}
}

// failingAggregate makes every publish of one aggregate fail until released.
type failingAggregate struct {
	outbox.Publisher
	agg      string
	released atomic.Bool
	attempts atomic.Int64
}

func (f *failingAggregate) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	if f.released.Load() {
		return f.Publisher.PublishBatch(ctx, msgs)
	}
	errs := make([]error, len(msgs))
	var pass []outbox.Envelope
	var idx []int
	for i, m := range msgs {
		if m.AggregateID == f.agg {
			f.attempts.Add(1)
			errs[i] = errors.New("injected failure for " + f.agg)
			continue
		}
		pass = append(pass, m)
		idx = append(idx, i)
	}
	for j, err := range f.Publisher.PublishBatch(ctx, pass) {
		errs[idx[j]] = err
	}
	return errs
}

// stallOnce holds up the first batch it is given that has an event of a
// healthy aggregate until another relay has re-claimed and published one of
// its rows (the lease of the held batch has ended), and then publishes it
// anyway: a relay that stalled past its lease in the middle of a publish (a
// paused process, a write stuck in the kernel) and wakes up to send stale
// copies. Its own deadline has passed by then, so the late publish gets a
// fresh one: the point is that the stale copies do reach the broker.
type stallOnce struct {
	outbox.Publisher
	stuck    string
	armed    atomic.Bool
	held     chan struct{} // closed once the batch is held; ids is set then
	ids      map[int64]bool
	reclaim  chan struct{} // closed when another relay published one of ids
	reclaimO sync.Once
}

func newStallOnce(pub outbox.Publisher, stuck string) *stallOnce {
	s := &stallOnce{Publisher: pub, stuck: stuck, held: make(chan struct{}), reclaim: make(chan struct{})}
	s.armed.Store(true)
	return s
}

func (s *stallOnce) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	healthy := slices.ContainsFunc(msgs, func(e outbox.Envelope) bool { return e.AggregateID != s.stuck })
	if !healthy || !s.armed.CompareAndSwap(true, false) {
		return s.Publisher.PublishBatch(ctx, msgs)
	}
	s.ids = map[int64]bool{}
	for _, m := range msgs {
		if m.AggregateID != s.stuck {
			s.ids[m.ID] = true
		}
	}
	close(s.held)
	select {
	case <-s.reclaim:
	case <-time.After(60 * time.Second): // the test fails on the missing re-claim
	}
	late, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	return s.Publisher.PublishBatch(late, msgs)
}

// published is the BatchDone hook of every relay: it releases the held batch
// once one of its rows went out through another worker.
func (s *stallOnce) published(ids []int64) {
	select {
	case <-s.held:
	default:
		return
	}
	for _, id := range ids {
		if s.ids[id] {
			s.reclaimO.Do(func() { close(s.reclaim) })
			return
		}
	}
}

// Three relays drain 10,000 events of 200 aggregates, half of them written
// while the relays run by concurrent writers, and the first relay's first
// batch stalls past its lease, is re-claimed and published by another worker,
// and then goes out again from the stale one. Every event arrives, each
// aggregate's events first arrive in order, more than one relay publishes, and
// an aggregate whose publishes keep failing holds back only its own events.
func TestThreeRelaysKeepPerAggregateOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestPool(t)
	b := newBroker(t, true)

	const aggregates, events, stuck = 200, 10_000, "o-13"
	var msgs []outbox.Message
	for i := range events {
		msgs = append(msgs, msg(fmt.Sprintf("o-%d", i%aggregates), "order.touched"))
	}
	var (
		mu      sync.Mutex
		written []outbox.Enqueued
		aggOf   = map[int64]string{}
	)
	record := func(chunk []outbox.Message, es []outbox.Enqueued) {
		mu.Lock()
		defer mu.Unlock()
		for j, e := range es {
			written = append(written, e)
			aggOf[e.ID] = chunk[j].AggregateID
		}
	}
	for chunk := range slices.Chunk(msgs[:events/2], 2000) {
		record(chunk, enqueue(t, pool, chunk...))
	}

	var (
		failing   []*failingAggregate
		published [3]atomic.Int64
		stall     *stallOnce
	)
	for i := range 3 {
		f := &failingAggregate{Publisher: newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil)), agg: stuck}
		failing = append(failing, f)
		cfg := relayConfig(t)
		cfg.MaxAttempts = 1_000_000 // this test is about holding back, not dead letters
		var pub outbox.Publisher = f
		if i == 0 {
			// The stalling relay's lease is short, so the others re-claim its
			// held batch soon.
			cfg.Lease, cfg.PublishTimeout = time.Second, 500*time.Millisecond
			stall = newStallOnce(f, stuck)
			pub = stall
		}
		cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
			published[i].Add(int64(len(r.Published)))
			// Any worker but the stalled one may re-claim the held batch
			// (once its lease ended it goes out whole, in one claim), the
			// stalling relay's other worker too.
			stall.published(r.Published)
		})
		startRelay(t, pool, pub, cfg)
		if i == 0 {
			select {
			case <-stall.held:
			case <-time.After(30 * time.Second):
				t.Fatal("the first relay never claimed a batch")
			}
		}
	}

	// Writers enqueue the other half while the relays run.
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for w, part := range slices.Collect(slices.Chunk(msgs[events/2:], events/2/4)) {
		wg.Go(func() {
			for chunk := range slices.Chunk(part, 10) {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					e, err := new(outbox.Writer).Enqueue(ctx, tx, chunk...)
					if err == nil {
						record(chunk, e)
					}
					return err
				})
				if err != nil {
					errs <- fmt.Errorf("writer %d: %w", w, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(written) != events {
		t.Fatalf("%d events written, want %d", len(written), events)
	}

	var others []outbox.Enqueued
	for _, e := range written {
		if aggOf[e.ID] != stuck {
			others = append(others, e)
		}
	}
	ds := b.WaitDeliveries("every event of the healthy aggregates", 90*time.Second, allReceived(others))
	for _, d := range ds {
		if d.Headers["aggregate_id"] == stuck {
			t.Fatalf("an event of the failing aggregate was delivered: %s", d.MessageId)
		}
	}
	var tries int64
	for _, f := range failing {
		tries += f.attempts.Load()
	}
	if tries < 2 {
		t.Fatalf("the failing aggregate was tried %d times", tries)
	}
	var stuckPending, stuckBlocked int
	err := pool.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE blocked) FROM outbox WHERE aggregate_id = $1", stuck).
		Scan(&stuckPending, &stuckBlocked)
	if err != nil {
		t.Fatal(err)
	}
	if stuckPending != events/aggregates || stuckBlocked != stuckPending-1 {
		t.Fatalf("failing aggregate: %d pending (%d blocked), want %d (all but its head)", stuckPending, stuckBlocked, events/aggregates)
	}

	for _, f := range failing {
		f.released.Store(true)
	}
	ds = b.WaitDeliveries("every event", 60*time.Second, allReceived(written))
	last := checkAggregateOrder(t, ds)
	if len(last) != aggregates {
		t.Fatalf("%d aggregates delivered, want %d", len(last), aggregates)
	}
	for agg, v := range last {
		if v != events/aggregates {
			t.Fatalf("aggregate %s reached version %d, want %d", agg, v, events/aggregates)
		}
	}
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	checkMarkedWereReceived(t, pool, b)

	// The held batch went out twice: from the relay that re-claimed it, and
	// late from the stale relay.
	select {
	case <-stall.reclaim:
	default:
		t.Fatal("no other relay re-claimed the held batch after its lease")
	}
	counts := receivedIDs(b.Deliveries())
	twice := 0
	for id := range stall.ids {
		if counts[id] >= 2 {
			twice++
		}
	}
	if twice == 0 {
		t.Fatal("no row of the held batch was delivered twice: the stale relay's late publish did not happen")
	}
	relays := 0
	for i := range published {
		if published[i].Load() > 0 {
			relays++
		}
	}
	if relays < 2 {
		t.Fatalf("published per relay: %d, %d, %d; want more than one relay publishing",
			published[0].Load(), published[1].Load(), published[2].Load())
	}
	t.Logf("published per relay: %d, %d, %d; %d rows of the held batch delivered twice",
		published[0].Load(), published[1].Load(), published[2].Load(), twice)
}

// Writers, relays and the broker together: the out-of-order commit case under
// load, with several aggregates written concurrently by transactions that stay
// open while relays mark.
func TestRelayUnderConcurrentWriters(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	b := newBroker(t, true)
	var relays []*outbox.Relay
	for range 2 {
		relays = append(relays, startRelay(t, pool, newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil)), relayConfig(t)))
	}
	var (
		mu      sync.Mutex
		written []outbox.Enqueued
		wg      sync.WaitGroup
	)
	errs := make(chan error, 6)
	for w := range 6 {
		wg.Go(func() {
			for i := range 50 {
				err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
					e, err := new(outbox.Writer).Enqueue(context.Background(), tx, msg(fmt.Sprintf("o-%d", (w+i)%8), "order.touched"))
					if err != nil {
						return err
					}
					mu.Lock()
					written = append(written, e...)
					mu.Unlock()
					_, err = tx.Exec(context.Background(), "SELECT pg_sleep(0.001)")
					return err
				})
				if err != nil {
					errs <- err
					return
				}
				relays[i%2].Wake()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	ds := b.WaitDeliveries("every event", 30*time.Second, allReceived(written))
	checkAggregateOrder(t, ds)
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	checkMarkedWereReceived(t, pool, b)
}

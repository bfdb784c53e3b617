package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// memPublisher keeps what the relay gives it, so the relay's own logic is
// tested without a broker. The RabbitMQ publisher and the relay over a real
// broker are tested in outboxamqp.
type memPublisher = outboxtest.MemPublisher

func testLogger(t testing.TB) *slog.Logger { return outboxtest.Logger(t) }

// fastConfig is a relay configuration that retries quickly, for tests.
var fastConfig = outboxtest.FastConfig

// checkOrder fails the test unless a consumer that applies version v of an
// aggregate only once it applied v-1 (and drops any other delivery) applies
// every version in envs in order, and returns the last version it applied
// per aggregate. Without copies, envs must be exactly that: each version
// once, in order. With copies, envs may also hold duplicates and early
// copies: a version sent before its predecessor (the rest of a run behind
// an event that failed, see RelayConfig.BatchSize), which must then come
// again after it.
func checkOrder(t testing.TB, envs []outbox.Envelope, copies bool) map[string]int64 {
	t.Helper()
	applied := map[string]int64{}
	early := map[string][]int64{}
	for _, e := range envs {
		prev := applied[e.AggregateID]
		switch v := e.AggregateVersion; {
		case v == prev+1:
			applied[e.AggregateID] = v
		case !copies:
			t.Fatalf("aggregate %s: version %d published after version %d", e.AggregateID, v, prev)
		case v > prev+1:
			early[e.AggregateID] = append(early[e.AggregateID], v)
		}
	}
	for agg, vs := range early {
		for _, v := range vs {
			if v > applied[agg] {
				t.Fatalf("aggregate %s: version %d was published before version %d, and never again after it", agg, v, v-1)
			}
		}
	}
	return applied
}

// sameJSON compares JSON documents: jsonb normalises spacing and key order.
func sameJSON(a, b []byte) bool {
	var x, y any
	return json.Unmarshal(a, &x) == nil && json.Unmarshal(b, &y) == nil && reflect.DeepEqual(x, y)
}

func TestRelayPublishesEveryEventOnceInAggregateOrder(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)

	var msgs []outbox.Message
	for v := range 5 {
		for a := range 20 {
			m := msg(fmt.Sprintf("o-%d", a), fmt.Sprintf("order.step%d", v))
			msgs = append(msgs, m)
		}
	}
	written := enqueue(t, pool, msgs...)

	pub := &memPublisher{}
	cfg := fastConfig(t)
	cfg.BatchSize = 7 // several batches
	startRelay(t, pool, pub, cfg)
	waitFor(t, "outbox drained", 20*time.Second, outboxEmpty(pool))

	got := pub.Snapshot()
	if len(got) != len(msgs) {
		t.Fatalf("published %d messages, want %d (no duplicate without a failure)", len(got), len(msgs))
	}
	checkOrder(t, got, false)

	// The envelope carries what was enqueued.
	byID := map[int64]outbox.Envelope{}
	for _, e := range got {
		byID[e.ID] = e
	}
	for i, w := range written {
		e, ok := byID[w.ID]
		if !ok {
			t.Fatalf("event %d never published", w.ID)
		}
		m := msgs[i]
		if e.AggregateType != m.AggregateType || e.AggregateID != m.AggregateID || e.EventType != m.EventType ||
			e.AggregateVersion != w.AggregateVersion || !sameJSON(e.Payload, m.Payload) ||
			e.Headers["traceparent"] != m.Headers["traceparent"] || e.Attempt != 1 || e.CreatedAt.IsZero() {
			t.Fatalf("envelope %+v does not match message %+v (version %d)", e, m, w.AggregateVersion)
		}
	}

	var published, versions int
	err := pool.QueryRow(context.Background(), `
SELECT count(*), (SELECT count(*) FROM outbox_aggregates a
                  WHERE a.version = (SELECT max(aggregate_version) FROM outbox_published p
                                     WHERE p.aggregate_type = a.aggregate_type AND p.aggregate_id = a.aggregate_id))
FROM outbox_published`).Scan(&published, &versions)
	if err != nil {
		t.Fatal(err)
	}
	if published != len(msgs) || versions != 20 {
		t.Fatalf("outbox_published has %d rows (want %d), %d aggregates fully published (want 20)", published, len(msgs), versions)
	}
}

// Writers and relays race on the same aggregates: writers hold an aggregate's
// lock while relays try to mark its previous event. No event may stay blocked,
// none may be published out of order.
func TestRelayWithConcurrentWritersKeepsOrderAndNeverStrandsARow(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	pub := &memPublisher{}
	cfg := fastConfig(t)
	cfg.Workers = 3
	r1 := startRelay(t, pool, pub, cfg)
	r2 := startRelay(t, pool, pub, cfg)

	const writers, perWriter, aggregates = 8, 40, 10
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Go(func() {
			for i := range perWriter {
				agg := fmt.Sprintf("o-%d", (w+i)%aggregates)
				err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
					if err := outbox.Enqueue(context.Background(), tx, msg(agg, "order.touched")); err != nil {
						return err
					}
					// Hold the aggregate's lock while relays work.
					_, err := tx.Exec(context.Background(), "SELECT pg_sleep(0.002)")
					return err
				})
				if err != nil {
					errs <- err
					return
				}
				r1.Wake()
				r2.Wake()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("writer: %v", err)
	}
	waitFor(t, "outbox drained", 30*time.Second, outboxEmpty(pool))

	got := pub.Snapshot()
	last := checkOrder(t, got, true)
	var total int64
	for _, v := range last {
		total += v
	}
	if total != writers*perWriter {
		t.Fatalf("highest versions add up to %d, want %d", total, writers*perWriter)
	}
}

// holdAggregate enqueues o-1's first event (committed), then its second in a
// transaction it leaves open (rolled back when the test ends), so a writer
// holds the aggregate's lock while the relay marks the first.
func holdAggregate(t *testing.T, pool *pgxpool.Pool) (first outbox.Enqueued, second []outbox.Enqueued, tx pgx.Tx) {
	t.Helper()
	ctx := context.Background()
	first = enqueue(t, pool, msg("o-1", "order.created"))[0]
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	second, err = new(outbox.Writer).Enqueue(ctx, tx, msg("o-1", "order.cancelled"))
	if err != nil {
		t.Fatal(err)
	}
	return first, second, tx
}

// A writer that holds an aggregate (its transaction enqueued the next event and
// is still open) delays the mark of the previous event, without blocking the
// relay or stranding either event.
func TestRelayMarkWaitsForAWriterHoldingTheAggregate(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	first, second, tx := holdAggregate(t, pool)

	published := make(chan []int64, 1)
	batches := make(chan outboxtest.BatchResult, 10)
	pub := &memPublisher{}
	cfg := fastConfig(t)
	cfg.Observer = outboxtest.OnConfirmed(cfg.Observer, func(ids []int64) {
		select {
		case published <- ids:
		default:
		}
	})
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	startRelay(t, pool, pub, cfg)

	select {
	case ids := <-published:
		if !slices.Equal(ids, []int64{first.ID}) {
			t.Fatalf("confirmed %v, want [%d]", ids, first.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("first event not published")
	}
	// The writer still holds the aggregate: the batch cannot be marked yet.
	select {
	case r := <-batches:
		t.Fatalf("batch done while the writer holds the aggregate: %+v", r)
	case <-time.After(200 * time.Millisecond):
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-batches
	if !slices.Equal(r.Published, []int64{first.ID}) || r.Err != nil {
		t.Fatalf("batch after commit = %+v, want %d published", r, first.ID)
	}
	waitFor(t, "second event published", 10*time.Second, outboxEmpty(pool))
	got := pub.Snapshot()
	if len(got) != 2 || got[1].ID != second[0].ID {
		t.Fatalf("published %+v, want the two events in order", got)
	}
}

// A failing event holds back the later events of its aggregate only; after
// MaxAttempts it is dead-lettered, visible to the operator, and an operator
// retry publishes it and then the events behind it.
func TestRelayFailingEventHoldsBackOnlyItsAggregateThenDeadLettersAndRetries(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	admin := outboxadmin.New(pool)

	bad := enqueue(t, pool, msg("bad", "order.created"), msg("bad", "order.cancelled"))
	var good []outbox.Message
	for i := range 30 {
		good = append(good, msg(fmt.Sprintf("good-%d", i), "order.created"))
	}
	enqueue(t, pool, good...)

	injected := errors.New("broker said no")
	pub := &memPublisher{}
	pub.SetFail(func(e outbox.Envelope) error {
		if e.AggregateID == "bad" {
			return injected
		}
		return nil
	})
	deadLettered := make(chan int64, 1)
	cfg := fastConfig(t)
	cfg.MaxAttempts = 3
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		for _, id := range r.DeadLettered {
			deadLettered <- id
		}
	})
	startRelay(t, pool, pub, cfg)

	select {
	case id := <-deadLettered:
		if id != bad[0].ID {
			t.Fatalf("dead-lettered %d, want %d", id, bad[0].ID)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("failing event never dead-lettered")
	}
	// Every other aggregate went through meanwhile.
	waitFor(t, "good events published", 10*time.Second, func() (bool, error) {
		return len(pub.Snapshot()) == len(good), nil
	})
	for _, e := range pub.Snapshot() {
		if e.AggregateID == "bad" {
			t.Fatalf("event %d of the failing aggregate was published", e.ID)
		}
	}

	dls, err := admin.DeadLetters(ctx, 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 || dls[0].ID != bad[0].ID || dls[0].Attempts != 3 ||
		dls[0].LastError != injected.Error() || dls[0].DeadLetteredAt.IsZero() || dls[0].EventType != "order.created" {
		t.Fatalf("dead letters = %+v", dls)
	}
	if b, err := json.Marshal(dls[0]); err != nil || !strings.Contains(string(b), `"payload":{"order_id":"bad"}`) {
		t.Fatalf("dead letter as JSON = %s, %v; want the payload as JSON", b, err)
	}
	st, err := admin.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The dead letter and the event behind it remain.
	if st.DeadLettered != 1 || st.Pending != 1 || st.OldestPendingAge <= 0 {
		t.Fatalf("status = %+v, want 1 dead letter and 1 pending", st)
	}

	pub.SetFail(nil)
	if err := admin.Retry(ctx, bad[0].ID); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if err := admin.Retry(ctx, bad[0].ID); !errors.Is(err, outboxadmin.ErrNotFound) {
		t.Fatalf("second retry of the same id: %v, want ErrNotFound", err)
	}
	waitFor(t, "retried events published", 10*time.Second, outboxEmpty(pool))
	var badOrder []int64
	for _, e := range pub.Snapshot() {
		if e.AggregateID == "bad" {
			badOrder = append(badOrder, e.AggregateVersion)
		}
	}
	if !slices.Equal(badOrder, []int64{1, 2}) {
		t.Fatalf("bad aggregate published versions %v, want [1 2]", badOrder)
	}
	var attempts int
	if err := pool.QueryRow(ctx, "SELECT attempts FROM outbox_published WHERE id = $1", bad[0].ID).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != 1 {
		t.Fatalf("retried event published with attempts %d, want 1 (reset by the retry)", attempts)
	}
	if st, err := admin.Status(ctx); err != nil || st != (outboxadmin.Status{}) {
		t.Fatalf("status after drain = %+v, %v; want zero", st, err)
	}
}

// A message the publisher never sent costs no attempt: an outage that keeps
// the publisher from sending must not dead-letter anything.
func TestRelayNotSentDoesNotCountAnAttempt(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]

	var calls int
	pub := &memPublisher{}
	pub.SetFail(func(outbox.Envelope) error {
		calls++ // under pub.mu
		if calls <= 5 {
			return fmt.Errorf("connection lost before sending: %w", outbox.ErrNotSent)
		}
		return nil
	})
	cfg := fastConfig(t)
	cfg.MaxAttempts = 2
	startRelay(t, pool, pub, cfg)
	waitFor(t, "event published", 10*time.Second, outboxEmpty(pool))

	var attempts int
	if err := pool.QueryRow(context.Background(), "SELECT attempts FROM outbox_published WHERE id = $1", e.ID).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != 1 {
		t.Fatalf("published with attempts = %d after 5 unsent tries, want 1", attempts)
	}
}

// A row leased by a relay that died is published by another relay when the
// lease ends, and the crash counts as an attempt.
func TestRelayRetriesRowsOfADeadRelayAfterTheLease(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]
	// What a claim does, by a relay that then dies.
	if _, err := pool.Exec(ctx, "UPDATE outbox SET attempts = 1, leased_until = now() + interval '300 milliseconds'"); err != nil {
		t.Fatal(err)
	}
	pub := &memPublisher{}
	startRelay(t, pool, pub, fastConfig(t))
	waitFor(t, "event published", 10*time.Second, outboxEmpty(pool))
	got := pub.Snapshot()
	if len(got) != 1 || got[0].ID != e.ID || got[0].Attempt != 2 {
		t.Fatalf("published %+v, want event %d at attempt 2", got, e.ID)
	}
}

func TestRelayWakesOnSignalAndOnNotify(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	channel := "outbox_test_wake_" + fmt.Sprint(time.Now().UnixNano())
	pub := &memPublisher{}
	cfg := fastConfig(t)
	cfg.PollInterval = time.Hour // only wake-ups can find new rows
	cfg.NotifyChannel = channel
	batches := make(chan outboxtest.BatchResult, 10)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	relay := startRelay(t, pool, pub, cfg)

	// In-process signal.
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]
	relay.Wake()
	select {
	case r := <-batches:
		if !slices.Equal(r.Published, []int64{e.ID}) {
			t.Fatalf("batch %+v, want %d published", r, e.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Wake did not make the relay publish")
	}

	// NOTIFY from a writer, once the relay listens.
	waitFor(t, "relay listening", 10*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE query = $1",
			"LISTEN "+pgx.Identifier{channel}.Sanitize()).Scan(&n)
		return n == 1, err
	})
	w, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: channel})
	if err != nil {
		t.Fatal(err)
	}
	var e2 []outbox.Enqueued
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		e2, err = w.Enqueue(ctx, tx, msg("o-2", "order.created"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-batches:
		if !slices.Equal(r.Published, []int64{e2[0].ID}) {
			t.Fatalf("batch %+v, want %d published", r, e2[0].ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("NOTIFY did not make the relay publish")
	}
}

func TestRelayFindsRowsByPollingAlone(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	pub := &memPublisher{}
	cfg := fastConfig(t)
	batches := make(chan outboxtest.BatchResult, 10)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	startRelay(t, pool, pub, cfg) // never woken
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]
	select {
	case r := <-batches:
		if !slices.Equal(r.Published, []int64{e.ID}) {
			t.Fatalf("batch %+v, want %d published", r, e.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the poll ticker did not find the row")
	}
}

// Cancelling Run lets the batch in flight finish: confirmed messages are marked,
// not abandoned to be published again.
func TestRelayStopFinishesTheBatchInFlight(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	e := enqueue(t, pool, msg("o-1", "order.created"))[0]

	entered := make(chan struct{})
	release := make(chan struct{})
	pub := &memPublisher{Block: func(context.Context) {
		close(entered)
		<-release
	}}
	relay, err := outbox.NewRelay(pool, pub, fastConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()

	<-entered
	cancel()
	select {
	case <-done:
		t.Fatal("Run returned before its batch in flight finished")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox_published WHERE id = $1", e.ID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatal("the confirmed event was not marked published before Run returned")
	}
}

func TestRelayRunTwiceIsAnError(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	batches := make(chan outboxtest.BatchResult, 1)
	cfg := fastConfig(t)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	relay := startRelay(t, pool, &memPublisher{}, cfg)
	enqueue(t, pool, msg("o-1", "order.created"))
	relay.Wake()
	<-batches // the first Run is running
	if err := relay.Run(context.Background()); err == nil {
		t.Fatal("second concurrent Run returned nil")
	}
}

func TestNewRelayValidatesConfig(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), testDatabaseURL()) // never connects
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pub := &memPublisher{}
	cases := map[string]outbox.RelayConfig{
		"negative batch":               {BatchSize: -1},
		"huge batch":                   {BatchSize: 1_000_000},
		"too many workers":             {Workers: 1000},
		"tiny poll":                    {PollInterval: time.Microsecond},
		"publish timeout beyond lease": {Lease: 10 * time.Second, PublishTimeout: 6 * time.Second},
		"backoff min above max":        {RetryBackoffMin: time.Minute, RetryBackoffMax: time.Second},
		"negative retention":           {PublishedRetention: -time.Hour},
		"NUL in channel":               {NotifyChannel: "a\x00b"},
		"long channel":                 {NotifyChannel: string(make([]byte, 64))},
		"huge purge batch":             {PurgeBatchSize: outboxsql.MaxPurgeBatch + 1},
		"vacuum every -2":              {VacuumEvery: -2},
		"tiny listen keepalive":        {ListenKeepalive: time.Microsecond},
		"negative listen keepalive":    {ListenKeepalive: -time.Second},
	}
	for name, cfg := range cases {
		if _, err := outbox.NewRelay(pool, pub, cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := outbox.NewRelay(nil, pub, outbox.RelayConfig{}); err == nil {
		t.Error("nil pool accepted")
	}
	if _, err := outbox.NewRelay(pool, nil, outbox.RelayConfig{}); err == nil {
		t.Error("nil publisher accepted")
	}
	if _, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{Lease: time.Second}); err != nil {
		t.Errorf("short lease with default publish timeout rejected: %v", err)
	}
}

// When a writer holds the aggregate past the time the lease allows for
// marking, the relay gives up marking: the row is published again after the
// lease, a duplicate and never a loss, and the order holds.
func TestRelayPublishesAgainWhatItCouldNotMark(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	first, second, tx := holdAggregate(t, pool)

	batches := make(chan outboxtest.BatchResult, 10)
	pub := &memPublisher{}
	cfg := fastConfig(t)
	cfg.Lease = 2 * time.Second
	cfg.PublishTimeout = time.Second
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) { batches <- r })
	startRelay(t, pool, pub, cfg)

	select {
	case r := <-batches:
		if !slices.Equal(r.Unmarked, []int64{first.ID}) || len(r.Published) != 0 || r.Err == nil {
			t.Fatalf("batch = %+v, want event %d unmarked with an error", r, first.ID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no batch")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "outbox drained", 10*time.Second, outboxEmpty(pool))
	var got []int64
	for _, e := range pub.Snapshot() {
		got = append(got, e.ID)
	}
	if want := []int64{first.ID, first.ID, second[0].ID}; !slices.Equal(got, want) {
		t.Fatalf("published %v, want %v", got, want)
	}
}

// Terminated database sessions (a failover, pg_terminate_backend) cost a
// retry: the workers reconnect through the pool, the listener reconnects, and
// wake-ups keep working.
func TestRelaySurvivesTerminatedDatabaseConnections(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := newTestPool(t)
	app := fmt.Sprintf("outbox_test_%d", time.Now().UnixNano())
	cfg := base.Config()
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	channel := app
	rc := fastConfig(t)
	rc.PollInterval = time.Hour // only wake-ups find rows
	rc.NotifyChannel = channel
	batches := make(chan outboxtest.BatchResult, 10)
	rc.Observer = outboxtest.OnBatch(rc.Observer, func(r outboxtest.BatchResult) { batches <- r })
	pub := &memPublisher{}
	relay := startRelay(t, pool, pub, rc)
	w, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: channel})
	if err != nil {
		t.Fatal(err)
	}
	listening := func() (bool, error) {
		var n int
		err := base.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'", app).Scan(&n)
		return n == 1, err
	}
	publishOne := func(agg string) {
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
		select {
		case r := <-batches:
			if !slices.Equal(r.Published, []int64{e[0].ID}) {
				t.Fatalf("batch %+v, want %d published", r, e[0].ID)
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("event %d not published", e[0].ID)
		}
	}

	enqueue(t, pool, msg("o-0", "order.created"))
	relay.Wake()
	<-batches // the pool has connections now
	waitFor(t, "relay listening", 10*time.Second, listening)
	publishOne("o-1")

	var killed int
	err = base.QueryRow(ctx, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&killed)
	if err != nil {
		t.Fatal(err)
	}
	if killed < 2 {
		t.Fatalf("terminated %d sessions, want the pool's and the listener's", killed)
	}
	waitFor(t, "relay listening again", 10*time.Second, listening)
	publishOne("o-2")
	publishOne("o-3")
}

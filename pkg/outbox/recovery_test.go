package outbox_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// killedPublisher stands for a relay process killed while its batches were
// in flight (a deploy without a graceful stop, an out-of-memory kill): it
// records each batch it is given, then ends the worker goroutine
// (runtime.Goexit) before any outcome is written, as SIGKILL would. The relay
// instance stops once every worker is gone.
type killedPublisher struct {
	mu      sync.Mutex
	batches [][]int64
}

func (p *killedPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p *killedPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	p.mu.Lock()
	p.batches = append(p.batches, ids)
	p.mu.Unlock()
	runtime.Goexit()
	return nil
}

// killRelay runs a relay whose every worker is killed in its first batch, and
// waits until it has stopped and the leases of its rows have ended. It returns
// the batches it had in flight.
func killRelay(t *testing.T, pool *pgxpool.Pool, cfg outbox.RelayConfig) [][]int64 {
	t.Helper()
	pub := &killedPublisher{}
	relay, err := outbox.NewRelay(pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	select {
	case err := <-done: // every worker gone
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the relay's workers did not all take a batch")
	}
	waitFor(t, "the killed relay's leases to end", 30*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox WHERE leased_until > now()").Scan(&n)
		return n == 0, err
	})
	pub.mu.Lock()
	defer pub.mu.Unlock()
	return pub.batches
}

// killConfig is a relay with a short lease, killed as killRelay does.
func killConfig(t *testing.T, workers, batchSize int) outbox.RelayConfig {
	cfg := fastConfig(t)
	cfg.Workers, cfg.BatchSize = workers, batchSize
	cfg.Lease, cfg.PublishTimeout = time.Second, 500*time.Millisecond
	cfg.PollInterval = 20 * time.Millisecond
	cfg.VacuumEvery = -1
	return cfg
}

// A relay killed with full batches in flight leaves every one of their rows
// in flight with no outcome. The relays after it must drain that backlog in
// full batches: a row whose relay stopped once is most likely the victim of a
// deploy or a kill, not its cause.
func TestRelayDrainsTheRowsOfAKilledRelayInFullBatches(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	const n, batch = 3000, 500
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = msg(fmt.Sprintf("o-%d", i), "order.created")
	}
	enqueue(t, pool, msgs...)

	killed := killRelay(t, pool, killConfig(t, 2, batch))
	var inFlight int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox WHERE in_flight").Scan(&inFlight); err != nil {
		t.Fatal(err)
	}
	if len(killed) != 2 || inFlight != 2*batch {
		t.Fatalf("killed relay: %d batches, %d rows in flight; want 2 and %d", len(killed), inFlight, 2*batch)
	}

	var (
		mu     sync.Mutex
		claims []int
	)
	cfg := killConfig(t, 2, batch)
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		mu.Lock()
		defer mu.Unlock()
		claims = append(claims, r.Claimed)
	})
	pub := &memPublisher{}
	startRelay(t, pool, pub, cfg)
	waitFor(t, "the backlog drained", 60*time.Second, outboxEmpty(pool))

	mu.Lock()
	defer mu.Unlock()
	if len(claims) > 2*n/batch {
		t.Fatalf("the backlog took %d claims, want at most %d: the killed relay's rows went out alone (claims %v...)",
			len(claims), 2*n/batch, claims[:min(len(claims), 20)])
	}
	if got := len(pub.Snapshot()); got != n {
		t.Fatalf("published %d events, want %d", got, n)
	}
	var twice int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox_published WHERE attempts = 2").Scan(&twice); err != nil {
		t.Fatal(err)
	}
	if twice != 2*batch {
		t.Fatalf("%d rows published at their second attempt, want the killed relay's %d", twice, 2*batch)
	}
}

// Only a row that was in flight at two stops in a row goes out alone: after
// one kill its batch goes out whole again; after a second kill with the same
// rows in flight, each of them goes alone, and a row that was never in
// flight still goes in a batch.
func TestOnlyARowInFlightAtTwoStopsInARowGoesOutAlone(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	var msgs []outbox.Message
	for i := range 10 {
		msgs = append(msgs, msg(fmt.Sprintf("o-%d", i), "order.created"))
	}
	first := enqueue(t, pool, msgs...)
	ids := make([]int64, len(first))
	for i, e := range first {
		ids[i] = e.ID
	}

	if got := killRelay(t, pool, killConfig(t, 1, 10)); len(got) != 1 || !slices.Equal(got[0], ids) {
		t.Fatalf("first relay's batches %v, want %v", got, ids)
	}
	if got := killRelay(t, pool, killConfig(t, 1, 10)); len(got) != 1 || !slices.Equal(got[0], ids) {
		t.Fatalf("after one stop, the relay's batches were %v, want the whole batch %v again", got, ids)
	}
	fresh := enqueue(t, pool, msg("fresh-1", "order.created"), msg("fresh-2", "order.created"))

	pub := &batchPublisher{}
	startRelay(t, pool, pub, killConfig(t, 1, 10))
	waitFor(t, "the backlog drained", 30*time.Second, outboxEmpty(pool))
	want := make([][]int64, 0, len(ids)+1)
	for _, id := range ids {
		want = append(want, []int64{id})
	}
	want = append(want, []int64{fresh[0].ID, fresh[1].ID})
	if got := pub.batchIDs(); !slices.EqualFunc(got, want, slices.Equal[[]int64]) {
		t.Fatalf("after two stops the batches were %v, want each of the twice-stopped rows alone, then the fresh ones together: %v", got, want)
	}
}

// batchPublisher confirms everything and keeps each batch's ids.
type batchPublisher struct {
	mu      sync.Mutex
	batches [][]int64
}

func (p *batchPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p *batchPublisher) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	p.mu.Lock()
	p.batches = append(p.batches, ids)
	p.mu.Unlock()
	return make([]error, len(msgs))
}

func (p *batchPublisher) batchIDs() [][]int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.batches)
}

package outboxwal_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// scriptPublisher confirms every message, records them in order, counts its
// calls, holds its first call until released, and fails the ids in fail
// once each.
type scriptPublisher struct {
	mu      sync.Mutex
	calls   int
	sent    []outbox.Envelope // confirmed, in order
	fail    map[int64]bool
	release chan struct{}
	held    chan struct{} // closed when the first call is held
	once    sync.Once
}

func newScriptPublisher() *scriptPublisher {
	return &scriptPublisher{fail: map[int64]bool{}, release: make(chan struct{}), held: make(chan struct{})}
}

func (p *scriptPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

func (p *scriptPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	p.once.Do(func() {
		close(p.held)
		select {
		case <-p.release:
		case <-ctx.Done():
		}
	})
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		if p.fail[m.ID] {
			delete(p.fail, m.ID)
			errs[i] = errors.New("nacked by the broker")
			continue
		}
		p.sent = append(p.sent, m)
	}
	return errs
}

func (p *scriptPublisher) snapshot() (int, []outbox.Envelope) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls, append([]outbox.Envelope(nil), p.sent...)
}

// One busy aggregate goes out in runs, a batch at a time, not one event per
// round trip: 1,200 events of one aggregate took 1,200 publishes, and an
// unrelated event waited behind them. Every event goes out once, in order.
func TestBusyAggregateGoesOutInRuns(t *testing.T) {
	pool := walPool(t)
	pub := newScriptPublisher()
	cfg := walConfig(t, pool)
	cfg.Workers = 1
	cfg.BatchSize = 100
	relay, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)
	enqueue(t, pool, msg("gate", "order.created"))
	<-pub.held // the only worker is busy: the stream piles up
	const n = 1200
	var all []outbox.Enqueued
	for i := 0; i < n; i += 100 {
		var ms []outbox.Message
		for range 100 {
			ms = append(ms, msg("hot", "order.updated"))
		}
		all = append(all, enqueue(t, pool, ms...)...)
	}
	other := enqueue(t, pool, msg("other", "order.created"))
	waitFor(t, "the stream decoded the writes", 30*time.Second, func() (bool, error) { return relay.Stats().InMemory >= n+2, nil })
	close(pub.release)
	waitFor(t, "every event published", 60*time.Second, func() (bool, error) {
		_, sent := pub.snapshot()
		return len(sent) >= n+2, nil
	})
	calls, sent := pub.snapshot()
	var v int64
	for _, e := range sent {
		if e.AggregateID != "hot" {
			continue
		}
		if e.AggregateVersion != v+1 {
			t.Fatalf("hot: version %d published after %d", e.AggregateVersion, v)
		}
		v = e.AggregateVersion
	}
	if v != n || len(sent) != n+2 {
		t.Fatalf("published %d events, hot up to version %d; want %d and %d", len(sent), v, n+2, n)
	}
	// The gate's call, then about n/BatchSize runs; one event per call
	// would take n.
	if calls > 3*n/cfg.BatchSize+5 {
		t.Fatalf("%d publishes for %d events of one aggregate in batches of %d", calls, n, cfg.BatchSize)
	}
	t.Logf("%d events of one aggregate (and %d, %d) in %d publishes", n, all[0].ID, other[0].ID, calls)
}

// When an event of a run fails, the later events of the run that the broker
// confirmed are not taken for published: they go to polling with the failed
// one, and go out again after it. The consumer may see v3 before v2's
// retry, but the last copy of each event arrives after its predecessors.
func TestFailureInARunPublishesTheRestAgainAfterIt(t *testing.T) {
	pool := walPool(t)
	pub := newScriptPublisher()
	cfg := walConfig(t, pool)
	cfg.Workers = 1
	relay, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)
	enqueue(t, pool, msg("gate", "order.created"))
	<-pub.held
	var evs []outbox.Enqueued
	for i := range 4 {
		evs = append(evs, enqueue(t, pool, msg("a", fmt.Sprintf("order.step%d", i+1)))...)
	}
	pub.mu.Lock()
	pub.fail[evs[1].ID] = true // v2
	pub.mu.Unlock()
	waitFor(t, "the stream decoded the writes", 30*time.Second, func() (bool, error) { return relay.Stats().InMemory >= 5, nil })
	close(pub.release)
	waitFor(t, "every event of a published after v2's retry", 60*time.Second, func() (bool, error) {
		_, sent := pub.snapshot()
		last := map[int64]int{}
		for i, e := range sent {
			if e.AggregateID == "a" {
				last[e.AggregateVersion] = i
			}
		}
		return len(last) == 4 && last[2] < last[3] && last[3] < last[4], nil
	})
	_, sent := pub.snapshot()
	var order []int64
	for _, e := range sent {
		if e.AggregateID == "a" {
			order = append(order, e.AggregateVersion)
		}
	}
	// v1 once; v3 and v4 went out in the run, then again after v2.
	if order[0] != 1 {
		t.Fatalf("a's deliveries %v: the first is not version 1", order)
	}
	last := map[int64]int{}
	for i, v := range order {
		last[v] = i
	}
	for v := int64(2); v <= 4; v++ {
		if last[v] < last[v-1] {
			t.Fatalf("a's deliveries %v: the last copy of version %d came before version %d's", order, v, v-1)
		}
	}
	t.Logf("a's deliveries: %v", order)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
}

// The events the relay holds in memory are bounded in bytes too: with a
// budget of about ten payloads, the stream stops being read at about ten
// events while the broker holds the first batch, not at MaxInMemory (it
// used to read on until MaxInMemory events of up to 1 MiB each). Once the
// broker answers, every event is published.
func TestInMemoryEventsAreBoundedInBytes(t *testing.T) {
	pool := walPool(t)
	pub := newScriptPublisher()
	cfg := walConfig(t, pool)
	cfg.Workers = 1
	const size, n = 20_000, 50
	cfg.MaxInMemoryBytes = 10 * size
	relay, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)
	big := func(id string) outbox.Message {
		m := msg(id, "order.created")
		m.Payload = []byte(`"` + strings.Repeat("x", size-2) + `"`)
		return m
	}
	enqueue(t, pool, big("gate"))
	<-pub.held
	for i := range n {
		enqueue(t, pool, big(fmt.Sprintf("o-%d", i)))
	}
	// The stream has all of it to read; give it time to read past the bound.
	time.Sleep(2 * time.Second)
	if got := relay.Stats().InMemory; got > 12 {
		t.Fatalf("%d events of %d bytes in memory, with a budget of %d bytes", got, size, cfg.MaxInMemoryBytes)
	}
	close(pub.release)
	waitFor(t, "every event published", 60*time.Second, func() (bool, error) {
		_, sent := pub.snapshot()
		return len(sent) >= n+1, nil
	})
}

package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// bytesPublisher records the most payload bytes it held in its batches at
// once, over every worker, and the batches it got. A batch holding the row
// uncounted is not counted.
type bytesPublisher struct {
	memPublisher
	uncounted int64
	mu        sync.Mutex
	holding   int
	most      int
	batches   [][]int64
}

func (p *bytesPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	n := 0
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		n += len(m.Payload)
		ids[i] = m.ID
	}
	if slices.Contains(ids, p.uncounted) {
		n = 0
	}
	p.mu.Lock()
	p.holding += n
	p.most = max(p.most, p.holding)
	p.batches = append(p.batches, ids)
	p.mu.Unlock()
	time.Sleep(20 * time.Millisecond) // the broker's confirm latency, so batches overlap
	defer func() {
		p.mu.Lock()
		p.holding -= n
		p.mu.Unlock()
	}()
	return p.memPublisher.PublishBatch(ctx, msgs)
}

// The relay holds at most MaxInFlightBytes of payloads in its batches at
// once, whatever BatchSize and Workers allow, and a single row larger than a
// worker's share still goes out, alone (beside the other worker's batch).
func TestRelayBoundsTheBytesInFlight(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	payload := func(n int) []byte { return []byte(`"` + strings.Repeat("x", n-2) + `"`) }

	var msgs []outbox.Message
	for i := range 40 {
		m := msg(fmt.Sprintf("o-%d", i), "order.created")
		m.Payload = payload(100_000)
		msgs = append(msgs, m)
	}
	enqueue(t, pool, msgs...)
	huge := msg("huge", "order.created")
	huge.Payload = payload(1_500_000)
	w, err := outbox.NewWriter(outbox.WriterConfig{MaxPayloadBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	var hugeID int64
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		e, err := w.Enqueue(ctx, tx, huge)
		if err == nil {
			hugeID = e[0].ID
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}

	const budget = 1_000_000
	pub := &bytesPublisher{uncounted: hugeID}
	cfg := fastConfig(t)
	cfg.Workers = 2
	cfg.BatchSize = 500
	cfg.MaxInFlightBytes = budget
	startRelay(t, pool, pub, cfg)
	waitFor(t, "outbox drained", 60*time.Second, outboxEmpty(pool))

	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.most > budget {
		t.Fatalf("the relay held %d bytes of payloads at once, more than MaxInFlightBytes (%d)", pub.most, budget)
	}
	var alone bool
	for _, b := range pub.batches {
		for _, id := range b {
			if id == hugeID {
				alone = len(b) == 1
			}
		}
	}
	if !alone {
		t.Fatal("the row larger than a worker's share did not go out alone")
	}
	if len(pub.batches) < 40*100_000/budget {
		t.Fatalf("%d batches for %d bytes, want at least %d of at most %d", len(pub.batches), 40*100_000, 40*100_000/budget, budget)
	}
}

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

// bytesPublisher records every batch it got with the bytes of its payloads,
// and the most payload bytes it held in its batches at once, over every
// worker. A batch of one row counts at most share (a worker's share of
// MaxInFlightBytes) toward that most: a row larger than the share is the one
// excess the bound allows, and it fills its worker's share.
type bytesPublisher struct {
	memPublisher
	share   int
	mu      sync.Mutex
	holding int
	most    int
	batches []bytesBatch
}

// bytesBatch is one batch a bytesPublisher got: its rows' ids and the bytes
// of their payloads.
type bytesBatch struct {
	ids   []int64
	bytes int
}

func (p *bytesPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	b := bytesBatch{ids: make([]int64, len(msgs))}
	for i, m := range msgs {
		b.bytes += len(m.Payload)
		b.ids[i] = m.ID
	}
	n := b.bytes
	if len(msgs) == 1 {
		n = min(n, p.share)
	}
	p.mu.Lock()
	p.holding += n
	p.most = max(p.most, p.holding)
	p.batches = append(p.batches, b)
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
// Every batch is checked, the huge row's too: a batch of more than one row
// stays within a worker's share, and only a batch of one row may exceed it,
// so at once the relay holds at most MaxInFlightBytes besides the excess of
// a row that went alone.
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
	const workers = 2
	pub := &bytesPublisher{share: budget / workers}
	cfg := fastConfig(t)
	cfg.Workers = workers
	cfg.BatchSize = 500
	cfg.MaxInFlightBytes = budget
	startRelay(t, pool, pub, cfg)
	waitFor(t, "outbox drained", 60*time.Second, outboxEmpty(pool))

	pub.mu.Lock()
	defer pub.mu.Unlock()
	var alone bool
	for _, b := range pub.batches {
		if len(b.ids) > 1 && b.bytes > pub.share {
			t.Fatalf("a batch of %d rows held %d bytes of payloads, more than a worker's share of MaxInFlightBytes (%d)", len(b.ids), b.bytes, pub.share)
		}
		if slices.Contains(b.ids, hugeID) {
			alone = len(b.ids) == 1
		}
	}
	if pub.most > budget {
		t.Fatalf("the relay held %d bytes of payloads at once (a row that went alone counted as a worker's share), more than MaxInFlightBytes (%d)", pub.most, budget)
	}
	if !alone {
		t.Fatal("the row larger than a worker's share did not go out alone")
	}
	if len(pub.batches) < 40*100_000/budget {
		t.Fatalf("%d batches for %d bytes, want at least %d of at most %d", len(pub.batches), 40*100_000, 40*100_000/budget, budget)
	}
}

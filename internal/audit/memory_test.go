package audit_test

import (
	"context"
	"iter"
	"runtime"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// bigProducer makes events 1..n as they are asked for, holding none.
type bigProducer struct{ n int64 }

func (p bigProducer) Events(ctx context.Context, w outboxaudit.EventWindow) iter.Seq2[outboxaudit.LoggedEvent, error] {
	return func(yield func(outboxaudit.LoggedEvent, error) bool) {
		for id := max(w.MinID, 1); id <= min(w.MaxID, p.n); id++ {
			if !yield(outboxaudit.LoggedEvent{ID: id, CreatedAt: now.Add(-time.Hour), State: outbox.EventPublished, Since: now.Add(-time.Hour)}, nil) {
				return
			}
		}
	}
}

func (p bigProducer) Lookup(ctx context.Context, ids []int64) ([]outboxaudit.LoggedEvent, error) {
	return nil, nil
}

// bigConsumer records the message ids 1..n but every skip-th, in byte
// order, as it is asked for them, and samples the heap as it goes.
type bigConsumer struct {
	n, skip int64
	peak    *uint64
}

// nextInByteOrder returns the number after x among 1..n in byte order of
// their decimal forms, or 0 after the last.
func nextInByteOrder(x, n int64) int64 {
	if x*10 <= n {
		return x * 10
	}
	for x%10 == 9 || x+1 > n {
		x /= 10
		if x == 0 {
			return 0
		}
	}
	return x + 1
}

func (c bigConsumer) Recorded(ctx context.Context, since time.Time, pageSize int) iter.Seq2[inbox.RecordedMessage, error] {
	return func(yield func(inbox.RecordedMessage, error) bool) {
		var ms runtime.MemStats
		i := 0
		for id := int64(1); id != 0; id = nextInByteOrder(id, c.n) {
			if i++; i%50_000 == 0 {
				runtime.ReadMemStats(&ms)
				*c.peak = max(*c.peak, ms.HeapInuse)
			}
			if id%c.skip == 0 {
				continue
			}
			if !yield(inbox.RecordedMessage{MessageID: outbox.MessageID(id, now.Add(-time.Hour)), ProcessedAt: now.Add(-time.Hour)}, nil) {
				return
			}
		}
	}
}

// The audit holds a page of each side, a batch of look-ups and a few
// examples, never the ids: auditing a million events, with ten thousand
// missing, takes no more heap than a few megabytes. (A million ids held as
// strings would take more than 20 MB, and in a map twice that.)
func TestAuditMemoryIsBounded(t *testing.T) {
	const n, skip = 1_000_000, 100
	var peak uint64
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	r, err := audit.Run(context.Background(), audit.Config{
		Producer: bigProducer{n: n}, Consumer: bigConsumer{n: n, skip: skip, peak: &peak},
		Since: now.Add(-2 * time.Hour), Until: now, Now: now,
	})
	if err != nil {
		t.Fatal(err)
	}
	if r.Checked != n || r.Missing.Count != n/skip || r.Applied.Count != n-n/skip || r.Phantom.Count != 0 {
		t.Fatalf("checked %d, applied %d, missing %d, phantom %d", r.Checked, r.Applied.Count, r.Missing.Count, r.Phantom.Count)
	}
	const limit = 16 << 20
	if grew := int64(peak) - int64(base); grew > limit {
		t.Fatalf("the heap grew by %d MB while auditing %d events, want at most %d MB", grew>>20, n, limit>>20)
	}
	t.Logf("heap in use: %d MB before, peak %d MB; %.0f events/s", base>>20, peak>>20, float64(n)/r.Seconds)
}

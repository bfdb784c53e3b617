package outboxtest

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// MemPublisher keeps what the relay gives it, so the relay's own logic
// (claiming, ordering, retries, dead letters) is tested without a broker: it
// confirms every message the function set by SetFail lets through, and keeps
// it.
type MemPublisher struct {
	mu        sync.Mutex
	published []outbox.Envelope
	fail      func(outbox.Envelope) error
	// Block, when set, is called at the start of each PublishBatch.
	Block func(ctx context.Context)
}

var _ outbox.Publisher = (*MemPublisher)(nil)

// WaitReady implements outbox.Publisher.
func (p *MemPublisher) WaitReady(ctx context.Context) error { return ctx.Err() }

// PublishBatch implements outbox.Publisher.
func (p *MemPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	p.mu.Lock()
	block, fail := p.Block, p.fail
	p.mu.Unlock()
	if block != nil {
		block(ctx)
	}
	errs := make([]error, len(msgs))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, m := range msgs {
		if fail != nil {
			if errs[i] = fail(m); errs[i] != nil {
				continue
			}
		}
		p.published = append(p.published, m)
	}
	return errs
}

// SetFail has f decide each later message's outcome: a message f returns an
// error for is refused with it; nil confirms every message. f runs under the
// publisher's lock.
func (p *MemPublisher) SetFail(f func(outbox.Envelope) error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail = f
}

// Snapshot returns the messages confirmed so far, in the order they came.
func (p *MemPublisher) Snapshot() []outbox.Envelope {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.published)
}

// FastConfig is a relay configuration that retries quickly, for tests.
func FastConfig(t testing.TB) outbox.RelayConfig {
	return outbox.RelayConfig{
		BatchSize:       100,
		PollInterval:    50 * time.Millisecond,
		Lease:           10 * time.Second,
		PublishTimeout:  5 * time.Second,
		RetryBackoffMin: 10 * time.Millisecond,
		RetryBackoffMax: 50 * time.Millisecond,
		Logger:          Logger(t),
	}
}

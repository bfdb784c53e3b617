package outbox_test

import (
	"context"
	"sync/atomic"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// relayCounters is an Observer that keeps the counters an operator alerts
// on. Wire the same switch to Prometheus, OpenTelemetry or expvar.
type relayCounters struct {
	published, claimFailed, markFailed, unmarked atomic.Int64
}

var _ outbox.Observer = (*relayCounters)(nil)

func (c *relayCounters) Observe(_ context.Context, o outbox.Observation) {
	switch o.Kind {
	case outbox.KindPublished:
		c.published.Add(int64(o.N))
	case outbox.KindClaimFailed:
		c.claimFailed.Add(1)
	case outbox.KindMarkFailed:
		c.markFailed.Add(1)
	case outbox.KindUnmarked:
		c.unmarked.Add(int64(o.N))
	}
	// Other kinds, those of later versions among them, are ignored: adding
	// a kind breaks no Observer.
}

// An Observer has one method: a new kind of observation is a new constant,
// never a new method to implement.
func ExampleObserver() {
	counters := &relayCounters{}
	cfg := outbox.RelayConfig{
		BatchSize: outbox.DefaultBatchSize, // the defaults are exported constants
		Observer:  counters,
	}
	_ = cfg // outbox.NewRelay(pool, publisher, cfg)
}

package outboxtest

import (
	"context"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/relayhook"
)

// observer hands every observation, and every point of relayhook, on to
// next, and calls the functions it has for them first.
type observer struct {
	next      outbox.Observer
	kind      outbox.ObservationKind
	f         func(outbox.Observation)
	confirmed func(ids []int64)
	batch     func(relayhook.BatchResult)
	acked     func(pos uint64)
}

var (
	_ relayhook.Confirmed    = (*observer)(nil)
	_ relayhook.BatchDone    = (*observer)(nil)
	_ relayhook.Acknowledged = (*observer)(nil)
)

func (o *observer) Observe(ctx context.Context, ob outbox.Observation) {
	if o.f != nil && ob.Kind == o.kind {
		o.f(ob)
	}
	if o.next != nil {
		o.next.Observe(ctx, ob)
	}
}

func (o *observer) Confirmed(ctx context.Context, ids relayhook.IDs) {
	if o.confirmed != nil {
		o.confirmed(ids)
	}
	if h, ok := o.next.(relayhook.Confirmed); ok {
		h.Confirmed(ctx, ids)
	}
}

func (o *observer) BatchDone(ctx context.Context, r relayhook.BatchResult) {
	if o.batch != nil {
		o.batch(r)
	}
	if h, ok := o.next.(relayhook.BatchDone); ok {
		h.BatchDone(ctx, r)
	}
}

func (o *observer) Acknowledged(ctx context.Context, pos relayhook.LSN) {
	if o.acked != nil {
		o.acked(uint64(pos))
	}
	if h, ok := o.next.(relayhook.Acknowledged); ok {
		h.Acknowledged(ctx, pos)
	}
}

// BatchResult is the outcome of one batch of the polling relay.
type BatchResult = relayhook.BatchResult

// On returns an Observer that calls f with the observations of kind k and
// hands every observation on to next (nil: none), so that a test adds what it
// waits on to whatever a configuration observes already:
//
//	cfg.Observer = outboxtest.On(cfg.Observer, outbox.KindPublished, f)
func On(next outbox.Observer, k outbox.ObservationKind, f func(outbox.Observation)) outbox.Observer {
	return &observer{next: next, kind: k, f: f}
}

// OnBatch calls f with the outcome of each batch (relayhook.BatchDone).
func OnBatch(next outbox.Observer, f func(BatchResult)) outbox.Observer {
	return &observer{next: next, batch: f}
}

// OnConfirmed calls f with the ids the broker confirmed in each batch,
// before the relay marks or sweeps them (relayhook.Confirmed).
func OnConfirmed(next outbox.Observer, f func(ids []int64)) outbox.Observer {
	return &observer{next: next, confirmed: f}
}

// OnAcknowledged calls f with each position a WAL relay acknowledged
// (relayhook.Acknowledged).
func OnAcknowledged(next outbox.Observer, f func(pos uint64)) outbox.Observer {
	return &observer{next: next, acked: f}
}

// HandOver returns pub for a relay that claims only the rows handed over to
// polling (relayhook.HandOver), as package outboxwal's hand-over relay.
func HandOver(pub outbox.Publisher) outbox.Publisher { return handOver{pub} }

type handOver struct{ outbox.Publisher }

func (handOver) HandOverOnly(relayhook.Token) {}

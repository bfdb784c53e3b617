package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// headerPublishSeq tags each republished message with its publish sequence
// number, so a basic.return can be matched to its publish.
const headerPublishSeq = "x-shipping-publish-seq"

var (
	errPublisherClosed = errors.New("publisher channel closed")
	errReturned        = errors.New("message returned by the broker: no queue bound for it")
	errNacked          = errors.New("message nacked by the broker")
)

// publisher publishes on its own confirm-mode channel and reports each
// message's fate: confirmed, nacked, or returned as unroutable (mandatory).
//
// One goroutine drains both the returns and the confirms. The broker sends a
// message's basic.return before its basic.ack, and the client hands the
// return to an unbuffered channel, so that goroutine has recorded the return
// before it can see the matching confirm.
type publisher struct {
	ch *amqp.Channel

	publishMu sync.Mutex // pairs a sequence number with its publish

	mu      sync.Mutex
	pending map[uint64]*pendingPublish

	done chan struct{} // closed when the channel is closed and all waiters failed
}

type pendingPublish struct {
	returned bool
	result   chan error // buffered 1
}

func newPublisher(conn *amqp.Connection, inFlight int) (*publisher, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open publish channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("enable publisher confirms: %w", err)
	}
	p := &publisher{ch: ch, pending: map[uint64]*pendingPublish{}, done: make(chan struct{})}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, inFlight))
	returns := ch.NotifyReturn(make(chan amqp.Return))
	go p.drain(confirms, returns)
	return p, nil
}

func (p *publisher) drain(confirms <-chan amqp.Confirmation, returns <-chan amqp.Return) {
	defer close(p.done)
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			seq, ok := r.Headers[headerPublishSeq].(int64)
			if !ok {
				continue
			}
			p.mu.Lock()
			if pp := p.pending[uint64(seq)]; pp != nil {
				pp.returned = true
			}
			p.mu.Unlock()
		case c, ok := <-confirms:
			if !ok {
				p.mu.Lock()
				for seq, pp := range p.pending {
					pp.result <- errPublisherClosed
					delete(p.pending, seq)
				}
				p.mu.Unlock()
				return
			}
			p.mu.Lock()
			pp := p.pending[c.DeliveryTag]
			delete(p.pending, c.DeliveryTag)
			p.mu.Unlock()
			switch {
			case pp == nil:
			case !c.Ack:
				pp.result <- errNacked
			case pp.returned:
				pp.result <- errReturned
			default:
				pp.result <- nil
			}
		}
	}
}

// publish sends msg (mandatory) and waits for the broker's verdict.
func (p *publisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	pp := &pendingPublish{result: make(chan error, 1)}
	msg.Headers = maps.Clone(msg.Headers)
	if msg.Headers == nil {
		msg.Headers = amqp.Table{}
	}

	p.publishMu.Lock()
	seq := p.ch.GetNextPublishSeqNo()
	msg.Headers[headerPublishSeq] = int64(seq)
	p.mu.Lock()
	p.pending[seq] = pp
	p.mu.Unlock()
	err := p.ch.PublishWithContext(ctx, exchange, key, true, false, msg)
	p.publishMu.Unlock()
	if err != nil {
		p.forget(seq)
		return fmt.Errorf("publish to %q/%q: %w", exchange, key, err)
	}

	select {
	case err := <-pp.result:
		if err != nil {
			return fmt.Errorf("publish to %q/%q: %w", exchange, key, err)
		}
		return nil
	case <-ctx.Done():
		p.forget(seq)
		return fmt.Errorf("publish to %q/%q: waiting for confirm: %w", exchange, key, ctx.Err())
	}
}

func (p *publisher) forget(seq uint64) {
	p.mu.Lock()
	delete(p.pending, seq)
	p.mu.Unlock()
}

func (p *publisher) close() {
	_ = p.ch.Close()
	<-p.done
}

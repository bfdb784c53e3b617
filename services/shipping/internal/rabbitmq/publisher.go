package rabbitmq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
)

// headerPublishSeq tags each republished message with its publish sequence
// number, so a basic.return can be matched to its publish.
const headerPublishSeq = "x-shipping-publish-seq"

var (
	errPublisherClosed = errors.New("publisher channel closed")
	// ErrReturned: the broker returned a mandatory message, no queue being
	// bound for it.
	ErrReturned   = errors.New("message returned by the broker: no queue bound for it")
	errNoExchange = errors.New("exchange not found: the broker closed the publishing channel")
	errNacked     = errors.New("message nacked by the broker")
	// errConfirmTimeout: no confirm within the republisher's timeout (the
	// broker blocks the publishing connection under a resource alarm, or
	// the queue has no leader).
	errConfirmTimeout = errors.New("no publisher confirm in time")
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
	// The client reports a channel's closing error before it closes the
	// confirms channel.
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, inFlight))
	returns := ch.NotifyReturn(make(chan amqp.Return))
	go p.drain(confirms, returns, closed)
	return p, nil
}

func (p *publisher) drain(confirms <-chan amqp.Confirmation, returns <-chan amqp.Return, closed <-chan *amqp.Error) {
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
				cause := errPublisherClosed
				select {
				case e := <-closed:
					if e != nil && e.Code == amqp.NotFound {
						// A publish to a deleted exchange.
						cause = fmt.Errorf("%w: %v", errNoExchange, e)
					}
				default:
				}
				p.mu.Lock()
				for seq, pp := range p.pending {
					pp.result <- cause
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
				pp.result <- ErrReturned
			default:
				pp.result <- nil
			}
		}
	}
}

// publish sends msg (mandatory) and waits for the broker's verdict.
func (p *publisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	seq, pp, err := p.send(ctx, exchange, key, msg)
	if err != nil {
		return err
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

// send sends msg (mandatory); the broker's verdict comes on pp.result.
func (p *publisher) send(ctx context.Context, exchange, key string, msg amqp.Publishing) (seq uint64, pp *pendingPublish, err error) {
	pp = &pendingPublish{result: make(chan error, 1)}
	msg.Headers = maps.Clone(msg.Headers)
	if msg.Headers == nil {
		msg.Headers = amqp.Table{}
	}

	p.publishMu.Lock()
	seq = p.ch.GetNextPublishSeqNo()
	msg.Headers[headerPublishSeq] = int64(seq)
	p.mu.Lock()
	p.pending[seq] = pp
	p.mu.Unlock()
	err = p.ch.PublishWithContext(ctx, exchange, key, true, false, msg)
	p.publishMu.Unlock()
	if err != nil {
		p.forget(seq)
		return 0, nil, fmt.Errorf("publish to %q/%q: %w", exchange, key, err)
	}
	return seq, pp, nil
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

func (p *publisher) closed() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// republisher publishes the consumer's deferred and dead-lettered copies on
// a connection of its own. Under a memory or disk alarm RabbitMQ blocks
// every connection that publishes (connection.blocked, sent after the
// connection's first publish since the alarm) until the alarm clears; the
// consuming connection, which only acks, keeps flowing. It dials on first
// use and again after its connection or channel is lost.
//
// While the connection is blocked, a publish sends nothing (the broker reads
// none of it, and a write can block once the socket's buffer is full): it
// waits until the connection is unblocked or lost. Each publish waits for
// its confirm at most timeout, not counting the time the connection is
// blocked: a queue without a leader never confirms, nor does a connection
// blocked without saying so. Past the timeout the publish fails with
// errConfirmTimeout and the connection is closed (which ends a blocked
// write), so that the worker can hand its delivery back.
type republisher struct {
	nodes    *amqpaddr.Nodes
	name     string
	inFlight int
	timeout  time.Duration // 0: DefaultConfirmTimeout
	log      *slog.Logger
	metrics  *metrics.Metrics // nil: none

	mu      sync.Mutex
	conn    *amqp.Connection
	pub     *publisher
	watcher sync.WaitGroup // the blocked-notification readers and the closes of dropped connections

	// bmu guards the current connection's blocked state. It is never held
	// while waiting: the reader of a connection's blocked notifications
	// takes it, and the connection's close waits for that reader.
	bmu      sync.Mutex
	bconn    *amqp.Connection // the connection blocked is about; nil: none
	blocked  bool
	bchanged chan struct{} // closed when blocked changes
}

// blockState reports whether the publishing connection is blocked, and a
// channel closed when that changes (unblocked, lost, or blocked).
func (r *republisher) blockState() (blocked bool, changed <-chan struct{}) {
	r.bmu.Lock()
	defer r.bmu.Unlock()
	if r.bchanged == nil {
		r.bchanged = make(chan struct{})
	}
	return r.blocked, r.bchanged
}

// setBlocked records whether conn, if it is the current connection, is
// blocked.
func (r *republisher) setBlocked(conn *amqp.Connection, blocked bool) {
	r.bmu.Lock()
	defer r.bmu.Unlock()
	if conn == r.bconn {
		r.setBlockedLocked(blocked)
	}
}

// track makes conn (nil: none) the connection the blocked state is about,
// not blocked yet.
func (r *republisher) track(conn *amqp.Connection) {
	r.bmu.Lock()
	defer r.bmu.Unlock()
	r.bconn = conn
	r.setBlockedLocked(false)
}

func (r *republisher) setBlockedLocked(blocked bool) {
	if r.blocked == blocked {
		return
	}
	r.blocked = blocked
	if r.bchanged != nil {
		close(r.bchanged)
	}
	r.bchanged = make(chan struct{})
}

// awaitUnblocked returns once the publishing connection is not blocked
// (unblocked, or lost), or with ctx's error.
func (r *republisher) awaitUnblocked(ctx context.Context) error {
	for {
		blocked, changed := r.blockState()
		if !blocked {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// current returns the open publisher, dialling a new connection if needed.
func (r *republisher) current() (*publisher, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pub != nil && !r.pub.closed() {
		return r.pub, nil
	}
	if r.pub != nil {
		r.log.Warn("publishing connection lost, reconnecting", "connection", r.name)
	}
	r.closeLocked()
	conn, _, err := dial(r.nodes, r.name)
	if err != nil {
		return nil, fmt.Errorf("dial publishing connection: %w", err)
	}
	pub, err := newPublisher(conn, r.inFlight)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	blocked := conn.NotifyBlocked(make(chan amqp.Blocking, 1))
	r.track(conn)
	r.watcher.Go(func() {
		for b := range blocked { // closed with the connection
			if b.Active {
				r.log.Warn("publishing connection blocked by the broker; deferrals and dead letters wait, acks flow",
					"connection", r.name, "reason", b.Reason)
			} else {
				r.log.Info("publishing connection unblocked", "connection", r.name)
			}
			r.setBlocked(conn, b.Active)
			if m := r.metrics; m != nil && b.Active {
				m.PublisherBlocked.Set(1)
			} else if m != nil {
				m.PublisherBlocked.Set(0)
			}
		}
		r.setBlocked(conn, false)
		if m := r.metrics; m != nil {
			m.PublisherBlocked.Set(0)
		}
	})
	r.conn, r.pub = conn, pub
	return pub, nil
}

// publish sends msg (mandatory) on the publishing connection, once it is
// not blocked, and waits for the broker's verdict, at most the
// republisher's timeout while the connection is not blocked
// (errConfirmTimeout).
func (r *republisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if err := r.awaitUnblocked(ctx); err != nil {
		return fmt.Errorf("publish to %q/%q: waiting for the publishing connection to be unblocked: %w", exchange, key, err)
	}
	pub, err := r.current()
	if err != nil {
		return err
	}
	timeout := cmp.Or(r.timeout, DefaultConfirmTimeout)
	tctx, cancel := context.WithTimeoutCause(ctx, timeout, errConfirmTimeout)
	// A write blocked on a blocked connection ends only with the connection.
	stop := context.AfterFunc(tctx, func() {
		if context.Cause(tctx) == errConfirmTimeout {
			r.drop(pub)
		}
	})
	seq, pp, err := pub.send(tctx, exchange, key, msg)
	stop()
	cancel()
	if err != nil {
		if context.Cause(tctx) == errConfirmTimeout {
			return r.timedOut(timeout, err)
		}
		return err
	}
	// The timeout runs while the connection is not blocked; its copy's
	// confirm comes once it is unblocked.
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		blocked, changed := r.blockState()
		var expired <-chan time.Time
		if !blocked {
			expired = timer.C
		}
		select {
		case err := <-pp.result:
			if errors.Is(err, errNacked) {
				// A channel that got a quorum queue's nack during a leader
				// election went on nacking on RabbitMQ 3.10: the next
				// publish dials anew.
				r.mu.Lock()
				if r.pub == pub {
					r.closeLocked()
				}
				r.mu.Unlock()
			}
			if err != nil {
				return fmt.Errorf("publish to %q/%q: %w", exchange, key, err)
			}
			return nil
		case <-ctx.Done():
			pub.forget(seq)
			return fmt.Errorf("publish to %q/%q: waiting for confirm: %w", exchange, key, ctx.Err())
		case <-expired:
			pub.forget(seq)
			r.drop(pub)
			return r.timedOut(timeout, fmt.Errorf("publish to %q/%q: waiting for confirm", exchange, key))
		case <-changed:
			if blocked {
				timer.Reset(timeout) // unblocked (or lost): the full timeout from now
			}
		}
	}
}

// timedOut logs a publish given up after timeout and returns its error.
func (r *republisher) timedOut(timeout time.Duration, err error) error {
	r.log.Warn("no publisher confirm in time: is the queue without a leader, or the broker blocking the connection without saying so? Dropping the publishing connection",
		"connection", r.name, "timeout", timeout, "error", err)
	return fmt.Errorf("%w (%v): %w", errConfirmTimeout, timeout, err)
}

func (r *republisher) closeLocked() {
	if r.conn == nil {
		return
	}
	closeConn(r.conn, r.pub)
	r.conn, r.pub = nil, nil
	r.track(nil)
}

// drop closes pub's connection, if it is still the current one, without
// waiting for it: the next publish dials a new one.
func (r *republisher) drop(pub *publisher) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pub != pub || r.conn == nil {
		return
	}
	conn := r.conn
	r.conn, r.pub = nil, nil
	r.track(nil)
	r.watcher.Go(func() { closeConn(conn, pub) })
}

// closeConn closes conn, whose publisher is pub. A blocked connection may
// never answer the close; it is shut down either way (the socket's deadline
// also ends a write blocked on it), and with it the publisher's channel.
func closeConn(conn *amqp.Connection, pub *publisher) {
	_ = conn.CloseDeadline(time.Now().Add(5 * time.Second))
	<-pub.done
}

// close closes the publishing connection, if any.
func (r *republisher) close() {
	r.mu.Lock()
	r.closeLocked()
	r.mu.Unlock()
	r.watcher.Wait()
}

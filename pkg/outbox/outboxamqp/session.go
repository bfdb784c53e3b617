package outboxamqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// flight is one message between its send and its verdict.
type flight struct {
	id       string // MessageId
	dc       *amqp.DeferredConfirmation
	returned atomic.Pointer[amqp.Return]
}

// session is one connection and the confirm-mode channels opened on it. It
// dies when the connection closes and is never revived: the Publisher dials a
// new one.
//
// Each batch publishes on a channel of its own for as long as it runs
// (acquire, release), so a fault on one channel (a nack, confirms that do not
// come by the deadline, the broker closing the channel on a message it
// refuses) fails that batch only: the channel is closed, and the other
// batches' channels, and the connection, go on. What the connection carries
// for all of them (a write stuck on a broker that stopped reading, a
// connection-level error) still ends every batch in flight.
//
// Every notification channel registered with the client is drained by a
// goroutine of the session, which ends when the client closes that channel.
type session struct {
	conn         *amqp.Connection
	wire         *wire // the connection's socket: a batch corks it while it sends
	log          *slog.Logger
	returnBuffer int
	node         string // host:port of the node connected to

	mu            sync.Mutex
	blocked       bool
	blockedReason string
	unblocked     chan struct{} // closed when the broker unblocks us
	deadCause     error
	idle          []*channel // channels no batch uses

	dead      chan struct{}
	deadOnce  sync.Once
	closeOnce sync.Once
	wg        sync.WaitGroup
}

var errClosedByPublisher = errors.New("closed by the publisher")

func newSession(conn *amqp.Connection, w *wire, log *slog.Logger, returnBuffer int) *session {
	s := &session{
		conn:         conn,
		wire:         w,
		log:          log,
		returnBuffer: returnBuffer,
		dead:         make(chan struct{}),
	}
	// Registered right after the handshake, so a block sent at once is not
	// missed.
	blocks := conn.NotifyBlocked(make(chan amqp.Blocking, 4))
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	s.wg.Go(func() { s.drainBlocked(blocks) })
	s.wg.Go(func() { s.watch(connClosed) })
	return s
}

// watch marks the session dead when the connection closes.
func (s *session) watch(connClosed <-chan *amqp.Error) {
	e := <-connClosed
	var cause error = errClosedByPublisher
	if e != nil {
		cause = e
	}
	s.markDead(cause)
	if e != nil {
		s.log.Warn("outboxamqp: connection lost", slog.Any("error", e))
	}
	s.close()
}

func (s *session) markDead(cause error) {
	s.deadOnce.Do(func() {
		s.mu.Lock()
		s.deadCause = cause
		s.mu.Unlock()
		close(s.dead)
	})
}

func (s *session) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}

func (s *session) cause() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.deadCause == nil {
		return errClosedByPublisher
	}
	return s.deadCause
}

// close closes the connection within a second even if a write is stuck on a
// broker that stopped reading. Every confirm still pending is then reported as
// not acked.
func (s *session) close() {
	s.closeOnce.Do(func() {
		s.markDead(errClosedByPublisher)
		if s.conn != nil {
			_ = s.conn.CloseDeadline(time.Now().Add(time.Second))
		}
	})
}

func (s *session) drainBlocked(blocks <-chan amqp.Blocking) {
	for b := range blocks {
		s.mu.Lock()
		changed := b.Active != s.blocked
		switch {
		case b.Active && !s.blocked:
			s.blocked, s.blockedReason = true, b.Reason
			s.unblocked = make(chan struct{})
		case !b.Active && s.blocked:
			s.blocked = false
			close(s.unblocked)
		}
		s.mu.Unlock()
		// Logged outside the lock: a slow logger must not hold up publishers.
		switch {
		case changed && b.Active:
			s.log.Warn("outboxamqp: broker blocked publishing", slog.String("reason", b.Reason))
		case changed:
			s.log.Info("outboxamqp: broker unblocked publishing")
		}
	}
}

// blockedBy returns the broker's reason when it is blocking publishers.
func (s *session) blockedBy() (reason string, blocked bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.blockedReason, s.blocked
}

// waitUnblocked returns nil when the broker accepts publishes, an error when the
// session died or ctx ended first.
func (s *session) waitUnblocked(ctx context.Context) error {
	s.mu.Lock()
	blocked, unblocked := s.blocked, s.unblocked
	s.mu.Unlock()
	if s.isDead() {
		return fmt.Errorf("connection lost: %w", s.cause())
	}
	if !blocked {
		return nil
	}
	select {
	case <-unblocked:
		return s.waitUnblocked(ctx)
	case <-s.dead:
		return fmt.Errorf("connection lost: %w", s.cause())
	case <-ctx.Done():
		return fmt.Errorf("broker blocked publishing: %w", ctx.Err())
	}
}

// acquire returns a channel for one batch: an idle one, or a new one.
func (s *session) acquire() (*channel, error) {
	s.mu.Lock()
	for len(s.idle) > 0 {
		c := s.idle[len(s.idle)-1]
		s.idle = s.idle[:len(s.idle)-1]
		if !c.isClosed() {
			s.mu.Unlock()
			return c, nil
		}
	}
	s.mu.Unlock()
	if s.isDead() {
		return nil, fmt.Errorf("connection lost: %w", s.cause())
	}
	return s.openChannel()
}

// release gives c back for another batch, unless it is closed.
func (s *session) release(c *channel) {
	if c.isClosed() || s.isDead() {
		return
	}
	s.mu.Lock()
	s.idle = append(s.idle, c)
	s.mu.Unlock()
}

// channel is one confirm-mode channel of a session, used by one batch at a
// time.
type channel struct {
	s       *session
	ch      *amqp.Channel
	writing atomic.Bool // a publish is in the client's hands (maybe stuck on a full socket)

	// inflight maps MessageId to its flight, for returns. A sync.Map, so the
	// returns reader never waits for a lock.
	inflight sync.Map
	strays   atomic.Int64 // returns that matched no flight, logged by PublishBatch

	returns   chan amqp.Return // buffered: see drainReturns
	syncReq   chan chan struct{}
	drainDone chan struct{}

	closing   atomic.Bool   // the publisher closes it: no batch may take it
	closed    chan struct{} // closed once the client closed it; cause is set then
	cause     error
	closeOnce sync.Once
}

// openChannel opens a confirm-mode channel, with a returns buffer of
// returnBuffer.
func (s *session) openChannel() (*channel, error) {
	ch, err := s.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	c := &channel{
		s:         s,
		ch:        ch,
		returns:   make(chan amqp.Return, s.returnBuffer),
		syncReq:   make(chan chan struct{}),
		drainDone: make(chan struct{}),
		closed:    make(chan struct{}),
	}
	ch.NotifyReturn(c.returns)
	closes := ch.NotifyClose(make(chan *amqp.Error, 1))
	s.wg.Go(c.drainReturns)
	s.wg.Go(func() { c.watch(closes) })
	if err := ch.Confirm(false); err != nil {
		c.close()
		return nil, fmt.Errorf("enable publisher confirms: %w", err)
	}
	return c, nil
}

// watch records why the channel closed: the broker's error, or nil when the
// publisher closed it (or the connection closed cleanly).
func (c *channel) watch(closes <-chan *amqp.Error) {
	var cause error = errClosedByPublisher
	if e, ok := <-closes; ok && e != nil {
		cause = e
	}
	c.cause = cause // read only after closed is closed
	close(c.closed)
}

func (c *channel) isClosed() bool {
	return c.closing.Load() || c.ch.IsClosed()
}

// closeCause reports whether the client closed the channel (the broker closed
// it, or the connection went), and why. The client marks it closed before it
// fails the pending confirms, and hands the cause over just after, so this
// waits briefly for it.
func (c *channel) closeCause() (error, bool) {
	if !c.ch.IsClosed() {
		return nil, false
	}
	t := time.NewTimer(time.Second)
	defer t.Stop()
	select {
	case <-c.closed:
		return c.cause, true
	case <-t.C:
		return errors.New("channel closed, cause unknown"), true
	}
}

// close closes the channel without waiting for the broker's answer. If that
// answer does not come within a second (a broker that stopped answering), the
// connection is closed: nothing on it can be trusted.
// retireUntilUnblocked takes c out of use at once (no batch takes it) and
// closes it once the broker accepts publishes again, or with the session.
func (c *channel) retireUntilUnblocked() {
	c.closing.Store(true)
	c.s.wg.Go(func() {
		_ = c.s.waitUnblocked(context.Background())
		c.close()
	})
}

func (c *channel) close() {
	c.closeOnce.Do(func() {
		c.closing.Store(true)
		c.s.wg.Go(func() {
			done := make(chan struct{})
			go func() {
				_ = c.ch.Close()
				close(done)
			}()
			t := time.NewTimer(time.Second)
			defer t.Stop()
			select {
			case <-done:
			case <-t.C:
				c.s.log.Warn("outboxamqp: the broker did not answer the close of a channel; closing the connection")
				c.s.close()
				<-done
			}
		})
	})
}

// drainReturns records each returned message on its flight. It never blocks,
// logs or takes a lock: the client waits at most 5s for a notification to be
// taken and then drops it, and a dropped return would let the message's ack
// count as a publish. The channel is buffered (Config.MaxInFlight), so the
// client does not even wait for this goroutine to be scheduled.
//
// RabbitMQ sends the basic.return of an unroutable mandatory message before its
// basic.ack, and the client puts the return into the buffer before it
// processes that ack. So once a caller has seen an ack, the message's return,
// if any, is either recorded or in the buffer: syncReturns has the buffer
// drained before the caller reads its verdicts.
func (c *channel) drainReturns() {
	defer close(c.drainDone)
	for {
		select {
		case r, ok := <-c.returns:
			if !ok {
				return
			}
			c.recordReturn(r)
		case req := <-c.syncReq:
			open := c.drainBuffered()
			close(req)
			if !open {
				return
			}
		}
	}
}

// drainBuffered records every return already in the buffer. It reports false
// when the client closed the channel.
func (c *channel) drainBuffered() bool {
	for {
		select {
		case r, ok := <-c.returns:
			if !ok {
				return false
			}
			c.recordReturn(r)
		default:
			return true
		}
	}
}

func (c *channel) recordReturn(r amqp.Return) {
	if f, ok := c.inflight.Load(r.MessageId); ok {
		f.(*flight).returned.Store(&r)
		return
	}
	c.strays.Add(1)
}

// syncReturns returns nil once every return the client has delivered so far
// is recorded. Called after a message's ack, it guarantees that message's
// return, if any, is visible on its flight. It fails only if ctx ends first.
func (c *channel) syncReturns(ctx context.Context) error {
	req := make(chan struct{})
	select {
	case c.syncReq <- req:
	case <-c.drainDone: // the client closed the channel: every return was recorded
		return nil
	case <-ctx.Done():
		return fmt.Errorf("wait for returns: %w", ctx.Err())
	}
	select {
	case <-req:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("wait for returns: %w", ctx.Err())
	}
}

func (c *channel) track(fs []*flight) {
	for _, f := range fs {
		c.inflight.Store(f.id, f)
	}
}

func (c *channel) untrack(fs []*flight) {
	for _, f := range fs {
		c.inflight.CompareAndDelete(f.id, f)
	}
}

// send publishes msgs in order and returns how many it handed to the client;
// errs holds the error of every message that got no deferred confirm. A
// message it cannot send holds back the rest of its aggregate's run
// (ErrNotSent): sent, they would reach the queues before it. If ctx
// ends while a write is stuck (a broker that stopped reading), the connection
// is closed to unblock it; a publish that has not started sees ctx and does
// not.
func (c *channel) send(ctx context.Context, exchange string, msgs []outbox.Envelope, fs []*flight,
	routingKey func(outbox.Envelope) string, publishing func(outbox.Envelope) (amqp.Publishing, error), errs []error,
) int {
	stop := context.AfterFunc(ctx, func() {
		if c.writing.Load() {
			c.s.close()
		}
	})
	defer stop()

	// One write for many messages (see wire). The last of them leave when
	// the batch has been framed, before any confirm is awaited.
	c.s.wire.cork()
	defer func() {
		c.writing.Store(true)
		var bound time.Time
		if ctx.Err() != nil {
			// The deadline has passed: stop above may have found no write
			// to end, so this one is bounded by itself.
			bound = time.Now().Add(time.Second)
		}
		_ = c.s.wire.uncork(bound) // a failure ends the connection: the confirms say so
		c.writing.Store(false)
	}()

	type aggregate struct{ typ, id string }
	var unsent map[aggregate]bool // aggregates with a message not sent
	holdBack := func(m outbox.Envelope) {
		if unsent == nil {
			unsent = map[aggregate]bool{}
		}
		unsent[aggregate{m.AggregateType, m.AggregateID}] = true
	}
	for i, m := range msgs {
		if unsent[aggregate{m.AggregateType, m.AggregateID}] {
			errs[i] = fmt.Errorf("outboxamqp: an earlier event of its aggregate could not be sent: %w", outbox.ErrNotSent)
			continue
		}
		if _, blocked := c.s.blockedBy(); blocked {
			// What was framed before the block goes out before the wait.
			c.writing.Store(true)
			_ = c.s.wire.flush()
			c.writing.Store(false)
		}
		if err := c.s.waitUnblocked(ctx); err != nil {
			fill(errs, i, fmt.Errorf("outboxamqp: %w: %w", err, outbox.ErrNotSent))
			return i
		}
		msg, err := publishing(m)
		if err != nil {
			// Never sent, but counted as an attempt: the message itself is
			// at fault, and would be refused again.
			errs[i] = err
			holdBack(m)
			continue
		}
		c.writing.Store(true)
		dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, routingKey(m), true, false, msg)
		c.writing.Store(false)
		switch {
		case err == nil && dc != nil:
			fs[i].dc = dc
		case err == nil:
			errs[i] = errors.New("outboxamqp: channel not in confirm mode")
		case errors.Is(err, amqp.ErrClosed) || ctx.Err() != nil && errors.Is(err, ctx.Err()):
			fill(errs, i, fmt.Errorf("outboxamqp: publish: %w: %w", err, outbox.ErrNotSent))
			return i
		case c.s.isDead():
			// The write failed halfway: the broker may or may not have it.
			errs[i] = fmt.Errorf("outboxamqp: publish (outcome unknown): %w", err)
			fill(errs, i+1, fmt.Errorf("outboxamqp: connection lost: %w", outbox.ErrNotSent))
			return i + 1
		default:
			// Refused by the client before sending, e.g. an invalid header.
			errs[i] = fmt.Errorf("outboxamqp: publish: %w", err)
			holdBack(m)
		}
	}
	return len(msgs)
}

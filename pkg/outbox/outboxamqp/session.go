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

// session is one connection and its confirm-mode channel. It dies on the first
// close of either and is never revived: the Publisher dials a new one.
//
// Every notification channel registered with the client is drained by a
// goroutine of the session, which ends when the client closes that channel.
type session struct {
	conn *amqp.Connection
	ch   *amqp.Channel
	log  *slog.Logger
	node string // host:port of the node connected to

	sendMu  sync.Mutex  // one batch sends at a time
	writing atomic.Bool // a publish is in the client's hands (maybe stuck on a full socket)

	// inflight maps MessageId to its flight, for returns. A sync.Map, so the
	// returns reader never waits for a lock.
	inflight sync.Map
	strays   atomic.Int64 // returns that matched no flight, logged by PublishBatch

	mu            sync.Mutex
	blocked       bool
	blockedReason string
	unblocked     chan struct{} // closed when the broker unblocks us
	deadCause     error

	returns   chan amqp.Return // buffered: see drainReturns
	syncReq   chan chan struct{}
	drainDone chan struct{}

	dead      chan struct{}
	deadOnce  sync.Once
	closeOnce sync.Once
	wg        sync.WaitGroup
}

var errClosedByPublisher = errors.New("closed by the publisher")

func newSession(conn *amqp.Connection, log *slog.Logger, returnBuffer int) (*session, error) {
	s := &session{
		conn:      conn,
		log:       log,
		returns:   make(chan amqp.Return, returnBuffer),
		syncReq:   make(chan chan struct{}),
		drainDone: make(chan struct{}),
		dead:      make(chan struct{}),
	}
	// Register on the connection first, so a block sent right after the
	// handshake is not missed.
	blocks := conn.NotifyBlocked(make(chan amqp.Blocking, 4))
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	s.wg.Go(func() { s.drainBlocked(blocks) })

	ch, err := conn.Channel()
	if err != nil {
		s.wg.Go(func() { s.watch(connClosed, nil) })
		return nil, fmt.Errorf("open channel: %w", err)
	}
	s.ch = ch
	ch.NotifyReturn(s.returns)
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	s.wg.Go(s.drainReturns)
	s.wg.Go(func() { s.watch(connClosed, chClosed) })
	if err := ch.Confirm(false); err != nil {
		s.close()
		return nil, fmt.Errorf("enable publisher confirms: %w", err)
	}
	return s, nil
}

// watch marks the session dead on the first close, and closes the connection if
// only the channel died, so everything of the session ends.
func (s *session) watch(connClosed, chClosed <-chan *amqp.Error) {
	var e *amqp.Error
	select {
	case e = <-connClosed:
	case e = <-chClosed: // nil channel when there is none: never ready
	}
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
func (s *session) drainReturns() {
	defer close(s.drainDone)
	for {
		select {
		case r, ok := <-s.returns:
			if !ok {
				return
			}
			s.recordReturn(r)
		case req := <-s.syncReq:
			open := s.drainBuffered()
			close(req)
			if !open {
				return
			}
		}
	}
}

// drainBuffered records every return already in the buffer. It reports false
// when the client closed the channel.
func (s *session) drainBuffered() bool {
	for {
		select {
		case r, ok := <-s.returns:
			if !ok {
				return false
			}
			s.recordReturn(r)
		default:
			return true
		}
	}
}

func (s *session) recordReturn(r amqp.Return) {
	if f, ok := s.inflight.Load(r.MessageId); ok {
		f.(*flight).returned.Store(&r)
		return
	}
	s.strays.Add(1)
}

// syncReturns returns nil once every return the client has delivered so far
// is recorded. Called after a message's ack, it guarantees that message's
// return, if any, is visible on its flight. It fails only if ctx ends first.
func (s *session) syncReturns(ctx context.Context) error {
	req := make(chan struct{})
	select {
	case s.syncReq <- req:
	case <-s.drainDone: // the client closed the channel: every return was recorded
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

func (s *session) track(fs []*flight) {
	for _, f := range fs {
		s.inflight.Store(f.id, f)
	}
}

func (s *session) untrack(fs []*flight) {
	for _, f := range fs {
		s.inflight.CompareAndDelete(f.id, f)
	}
}

// send publishes msgs in order and returns how many it handed to the client;
// errs holds the error of every message that got no deferred confirm. If ctx
// ends while a write is stuck (a broker that stopped reading), the session is
// closed to unblock it; a publish that has not started sees ctx and does not.
func (s *session) send(ctx context.Context, exchange string, msgs []outbox.Envelope, fs []*flight,
	routingKey func(outbox.Envelope) string, errs []error,
) int {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	stop := context.AfterFunc(ctx, func() {
		if s.writing.Load() {
			s.close()
		}
	})
	defer stop()

	for i, m := range msgs {
		if err := s.waitUnblocked(ctx); err != nil {
			fill(errs, i, fmt.Errorf("outboxamqp: %w: %w", err, outbox.ErrNotSent))
			return i
		}
		s.writing.Store(true)
		dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, routingKey(m), true, false, Publishing(m))
		s.writing.Store(false)
		switch {
		case err == nil && dc != nil:
			fs[i].dc = dc
		case err == nil:
			errs[i] = errors.New("outboxamqp: channel not in confirm mode")
		case errors.Is(err, amqp.ErrClosed) || ctx.Err() != nil && errors.Is(err, ctx.Err()):
			fill(errs, i, fmt.Errorf("outboxamqp: publish: %w: %w", err, outbox.ErrNotSent))
			return i
		case s.isDead():
			// The write failed halfway: the broker may or may not have it.
			errs[i] = fmt.Errorf("outboxamqp: publish (outcome unknown): %w", err)
			fill(errs, i+1, fmt.Errorf("outboxamqp: connection lost: %w", outbox.ErrNotSent))
			return i + 1
		default:
			// Refused by the client before sending, e.g. an invalid header.
			errs[i] = fmt.Errorf("outboxamqp: publish: %w", err)
		}
	}
	return len(msgs)
}

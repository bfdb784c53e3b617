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

	sendMu  sync.Mutex  // one batch sends at a time
	writing atomic.Bool // a publish is in the client's hands (maybe stuck on a full socket)

	mu        sync.Mutex
	inflight  map[string]*flight // by MessageId, for returns
	blocked   bool
	unblocked chan struct{} // closed when the broker unblocks us
	deadCause error

	returns   chan amqp.Return
	syncReq   chan chan struct{}
	drainDone chan struct{}

	dead      chan struct{}
	deadOnce  sync.Once
	closeOnce sync.Once
	wg        sync.WaitGroup
}

var errClosedByPublisher = errors.New("closed by the publisher")

func newSession(conn *amqp.Connection, log *slog.Logger) (*session, error) {
	s := &session{
		conn:      conn,
		log:       log,
		inflight:  map[string]*flight{},
		returns:   make(chan amqp.Return), // unbuffered: see syncReturns
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
		switch {
		case b.Active && !s.blocked:
			s.blocked = true
			s.unblocked = make(chan struct{})
			s.log.Warn("outboxamqp: broker blocked publishing", slog.String("reason", b.Reason))
		case !b.Active && s.blocked:
			s.blocked = false
			close(s.unblocked)
			s.log.Info("outboxamqp: broker unblocked publishing")
		}
		s.mu.Unlock()
	}
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

// drainReturns records each returned message on its flight. The broker sends a
// basic.return before the ack of the same message, and the client hands it to
// this goroutine (unbuffered) before it processes that ack.
func (s *session) drainReturns() {
	defer close(s.drainDone)
	for {
		select {
		case r, ok := <-s.returns:
			if !ok {
				return
			}
			s.mu.Lock()
			f := s.inflight[r.MessageId]
			s.mu.Unlock()
			if f == nil {
				s.log.Warn("outboxamqp: return for a message no longer awaited",
					slog.String("event_id", r.MessageId), slog.Int("reply_code", int(r.ReplyCode)), slog.String("reply_text", r.ReplyText))
				continue
			}
			f.returned.Store(&r)
		case req := <-s.syncReq:
			close(req)
		}
	}
}

// syncReturns returns once every return the client has delivered so far is
// recorded. Called after a message's ack, it guarantees that message's return,
// if any, is visible on its flight.
func (s *session) syncReturns() {
	req := make(chan struct{})
	select {
	case s.syncReq <- req:
		<-req
	case <-s.drainDone: // channel closed: every return was received
	}
}

func (s *session) track(fs []*flight) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range fs {
		s.inflight[f.id] = f
	}
}

func (s *session) untrack(fs []*flight) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range fs {
		if s.inflight[f.id] == f {
			delete(s.inflight, f.id)
		}
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

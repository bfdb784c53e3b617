// Package redial keeps a broker publisher's one connection, whatever the
// broker: it dials when there is no live session, one dialler at a time,
// with jittered exponential backoff between failed attempts, remembers the
// last failure for a readiness probe, and closes what a dial returns after
// Close. outboxamqp and outboxnats plug their sessions into it.
package redial

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
)

// Config says how to dial and judge a session of type *T.
type Config[T any] struct {
	// Name prefixes the log messages, e.g. "outboxamqp".
	Name string
	// Min and Max bound the backoff between failed dials.
	Min, Max time.Duration
	Logger   *slog.Logger
	// Dial opens a session.
	Dial func(context.Context) (*T, error)
	// Dead reports whether a session is lost or closed.
	Dead func(*T) bool
	// Cause returns why a dead session was lost.
	Cause func(*T) error
	// Discard, when set, is called on the dead session before a new one is
	// dialled.
	Discard func(*T)
	// Close closes a session a dial returned after Conn.Close.
	Close func(*T)
	// ErrClosed is returned by Session and Ready after Conn.Close;
	// ErrNotConnected is wrapped by Ready's error while no session is live.
	ErrClosed, ErrNotConnected error
}

// Conn holds the current session. It is safe for concurrent use.
type Conn[T any] struct {
	cfg Config[T]
	mu  chan struct{} // one dialler at a time; a channel so waiting honours ctx

	sess      atomic.Pointer[T]
	failures  int                   // consecutive failed dials, under mu
	dialErr   atomic.Pointer[error] // the last failed dial's error; nil once connected
	closed    atomic.Bool
	closeOnce sync.Once
	closing   chan struct{}
}

// New returns a Conn that has not dialled yet.
func New[T any](cfg Config[T]) *Conn[T] {
	return &Conn[T]{cfg: cfg, mu: make(chan struct{}, 1), closing: make(chan struct{})}
}

// Load returns the last session dialled, live or dead, or nil.
func (c *Conn[T]) Load() *T { return c.sess.Load() }

// Session returns the live session, dialling a new one if needed, with
// backoff after failures, for as long as ctx lasts.
func (c *Conn[T]) Session(ctx context.Context) (*T, error) {
	select {
	case c.mu <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-c.closing:
		return nil, c.cfg.ErrClosed
	}
	defer func() { <-c.mu }()
	for {
		if c.closed.Load() {
			return nil, c.cfg.ErrClosed
		}
		if s := c.sess.Load(); s != nil && !c.cfg.Dead(s) {
			return s, nil
		}
		if old := c.sess.Load(); old != nil && c.cfg.Discard != nil {
			c.cfg.Discard(old)
		}
		if c.failures > 0 {
			wait := retry.Jitter(retry.Backoff(c.failures, c.cfg.Min, c.cfg.Max))
			if err := retry.SleepOrStop(ctx, wait, c.closing); errors.Is(err, retry.ErrStopped) {
				return nil, c.cfg.ErrClosed
			} else if err != nil {
				return nil, err
			}
		}
		s, err := c.cfg.Dial(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			c.failures++
			c.dialErr.Store(&err)
			c.cfg.Logger.WarnContext(ctx, c.cfg.Name+": connect failed, retrying", slog.Any("error", err), slog.Int("failures", c.failures))
			continue
		}
		if c.failures > 0 {
			c.cfg.Logger.InfoContext(ctx, c.cfg.Name+": connected after failures", slog.Int("failures", c.failures))
		}
		c.failures = 0
		c.dialErr.Store(nil)
		c.sess.Store(s)
		if c.closed.Load() { // Close ran while dialling
			c.cfg.Close(s)
			return nil, c.cfg.ErrClosed
		}
		return s, nil
	}
}

// Ready returns the live session without dialling or waiting, or an error:
// ErrClosed, or one wrapping ErrNotConnected with the lost session's cause
// and the last failed dial's error.
func (c *Conn[T]) Ready() (*T, error) {
	if c.closed.Load() {
		return nil, c.cfg.ErrClosed
	}
	s := c.sess.Load()
	if s == nil || c.cfg.Dead(s) {
		err := c.cfg.ErrNotConnected
		if s != nil {
			err = fmt.Errorf("%w: connection lost: %w", c.cfg.ErrNotConnected, c.cfg.Cause(s))
		}
		if last := c.dialErr.Load(); last != nil {
			err = fmt.Errorf("%w (last attempt: %w)", err, *last)
		}
		return nil, err
	}
	return s, nil
}

// Close makes later Session and Ready calls return ErrClosed, waits for a
// dial in progress, and calls closeSession on the last session dialled, if
// any.
func (c *Conn[T]) Close(closeSession func(*T)) {
	c.closeOnce.Do(func() {
		c.closed.Store(true)
		close(c.closing)
	})
	c.mu <- struct{}{}
	defer func() { <-c.mu }()
	if s := c.sess.Load(); s != nil {
		closeSession(s)
	}
}

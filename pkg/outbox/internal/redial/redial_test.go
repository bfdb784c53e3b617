package redial

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"
)

type fakeSession struct {
	dead   bool
	closed bool
}

var (
	errClosed       = errors.New("closed")
	errNotConnected = errors.New("not connected")
	errLost         = errors.New("lost")
)

func newConn(dial func(context.Context) (*fakeSession, error)) *Conn[fakeSession] {
	return New(Config[fakeSession]{
		Name: "test", Min: time.Millisecond, Max: time.Millisecond,
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		Dial:      dial,
		Dead:      func(s *fakeSession) bool { return s.dead },
		Cause:     func(*fakeSession) error { return errLost },
		Close:     func(s *fakeSession) { s.closed = true },
		ErrClosed: errClosed, ErrNotConnected: errNotConnected,
	})
}

// A failed dial is retried; Ready names the last failure until a dial
// succeeds, then the lost session's cause once it dies; a live session is
// reused, a dead one replaced.
func TestSessionRedialsAndReadySaysWhy(t *testing.T) {
	refused := errors.New("refused")
	dials := 0
	c := newConn(func(context.Context) (*fakeSession, error) {
		dials++
		if dials == 1 {
			return nil, refused
		}
		return &fakeSession{}, nil
	})
	if _, err := c.Ready(); !errors.Is(err, errNotConnected) {
		t.Fatalf("Ready before any dial: %v, want errNotConnected", err)
	}
	s, err := c.Session(context.Background())
	if err != nil || dials != 2 {
		t.Fatalf("Session: %v after %d dials, want a session after 2", err, dials)
	}
	if got, err := c.Ready(); got != s || err != nil {
		t.Fatalf("Ready: %v, %v, want the session", got, err)
	}
	if again, _ := c.Session(context.Background()); again != s || dials != 2 {
		t.Fatalf("a live session was not reused (%d dials)", dials)
	}
	s.dead = true
	if _, err := c.Ready(); !errors.Is(err, errNotConnected) || !errors.Is(err, errLost) {
		t.Fatalf("Ready after the loss: %v, want errNotConnected and the cause", err)
	}
	if next, _ := c.Session(context.Background()); next == s || dials != 3 {
		t.Fatalf("a dead session was not replaced (%d dials)", dials)
	}
}

// Close closes the session, and one a dial returns after it; later calls
// get ErrClosed.
func TestCloseClosesTheSessionAndRefusesLaterCalls(t *testing.T) {
	var c *Conn[fakeSession]
	var late *fakeSession
	c = newConn(func(context.Context) (*fakeSession, error) {
		late = &fakeSession{}
		c.closeOnce.Do(func() { c.closed.Store(true); close(c.closing) }) // Close's first step, during the dial
		return late, nil
	})
	if _, err := c.Session(context.Background()); !errors.Is(err, errClosed) {
		t.Fatalf("Session closed while dialling: %v, want errClosed", err)
	}
	if !late.closed {
		t.Fatal("the session dialled during Close was not closed")
	}
	var closedByClose *fakeSession
	c.Close(func(s *fakeSession) { closedByClose = s })
	if closedByClose != late {
		t.Fatal("Close did not close the last session")
	}
	if _, err := c.Ready(); !errors.Is(err, errClosed) {
		t.Fatalf("Ready after Close: %v", err)
	}
	if _, err := c.Session(context.Background()); !errors.Is(err, errClosed) {
		t.Fatalf("Session after Close: %v", err)
	}
}

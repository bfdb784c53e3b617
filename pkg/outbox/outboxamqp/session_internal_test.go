package outboxamqp

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// A broker cannot be made to block one test's connection without blocking
// every publisher on it, so the blocked/unblocked state machine is tested on
// its own, fed the notifications the client would deliver.
func TestBlockedConnectionPausesPublishingUntilUnblocked(t *testing.T) {
	t.Parallel()
	s := &session{
		log:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		dead: make(chan struct{}),
		wire: &wire{}, // nothing reaches it: send writes nothing while blocked
	}
	// notify hands b to the session as the client would, and returns once the
	// session has acted on it: blocks is unbuffered, so the repeated send is
	// taken only after drainBlocked finished with the first (the repeat
	// changes nothing). Sending once and going on raced with drainBlocked:
	// send could find the session not yet blocked and publish.
	blocks := make(chan amqp.Blocking)
	notify := func(b amqp.Blocking) {
		blocks <- b
		blocks <- b
	}
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		s.drainBlocked(blocks)
	}()
	defer func() {
		close(blocks)
		<-drained
	}()

	if err := s.waitUnblocked(context.Background()); err != nil {
		t.Fatalf("not blocked yet: %v", err)
	}
	notify(amqp.Blocking{Active: true, Reason: "low on memory"})

	// A batch sent while blocked sends nothing and says so, once its deadline
	// passes: the messages are retried without counting an attempt.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	msgs := []outbox.Envelope{{ID: 1}, {ID: 2}}
	errs := make([]error, len(msgs))
	c := &channel{s: s}
	if n := c.send(ctx, "x", msgs, []*flight{{id: "1"}, {id: "2"}}, func(outbox.Envelope) string { return "k" }, func(e outbox.Envelope) (amqp.Publishing, error) { return Publishing(e), nil }, errs); n != 0 {
		t.Fatalf("sent %d messages while blocked", n)
	}
	for i, err := range errs {
		if !errors.Is(err, outbox.ErrNotSent) {
			t.Fatalf("message %d: %v, want ErrNotSent", i, err)
		}
	}
	if s.isDead() {
		t.Fatal("a deadline while blocked killed the session; nothing was stuck")
	}

	waited := make(chan error, 1)
	go func() { waited <- s.waitUnblocked(context.Background()) }()
	select {
	case err := <-waited:
		t.Fatalf("waitUnblocked returned %v while blocked", err)
	case <-time.After(50 * time.Millisecond):
	}
	notify(amqp.Blocking{Active: false})
	select {
	case err := <-waited:
		if err != nil {
			t.Fatalf("after unblock: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("still waiting after the broker unblocked")
	}

	// A session that dies while blocked releases its waiters with an error.
	notify(amqp.Blocking{Active: true, Reason: "disk alarm"})
	go func() { waited <- s.waitUnblocked(context.Background()) }()
	s.markDead(errors.New("connection reset"))
	select {
	case err := <-waited:
		if err == nil {
			t.Fatal("waitUnblocked on a dead session returned nil")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("waiter not released when the session died")
	}
}

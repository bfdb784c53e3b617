package outboxamqp

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// socket is a net.Conn that records each write it is given, and can be
// made to fail them.
type socket struct {
	net.Conn // nil: only Write and Close are called
	mu       sync.Mutex
	writes   [][]byte
	fail     error
	closed   bool
}

func (s *socket) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return 0, s.fail
	}
	s.writes = append(s.writes, bytes.Clone(p))
	return len(p), nil
}

func (s *socket) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	return nil
}

func (s *socket) got() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, w := range s.writes {
		out = append(out, string(w))
	}
	return out
}

func write(t *testing.T, w *wire, s string) {
	t.Helper()
	if n, err := w.Write([]byte(s)); err != nil || n != len(s) {
		t.Fatalf("Write(%q) = %d, %v", s, n, err)
	}
}

func TestWireGathersACorkedBatchIntoOneWrite(t *testing.T) {
	t.Parallel()
	sock := &socket{}
	w := &wire{Conn: sock}

	write(t, w, "open")
	w.cork()
	write(t, w, "a")
	write(t, w, "b")
	write(t, w, "c")
	if got := sock.got(); len(got) != 1 {
		t.Fatalf("corked writes reached the socket: %q", got)
	}
	if err := w.uncork(time.Time{}); err != nil {
		t.Fatal(err)
	}
	write(t, w, "after")
	if got, want := strings.Join(sock.got(), "|"), "open|abc|after"; got != want {
		t.Fatalf("socket writes %q, want %q", got, want)
	}
}

// Two batches on two channels of one connection: the first to uncork writes
// everything gathered so far, in the client's order, and the other's later
// frames wait for its own uncork.
func TestWireCorksNest(t *testing.T) {
	t.Parallel()
	sock := &socket{}
	w := &wire{Conn: sock}
	w.cork()
	write(t, w, "a1")
	w.cork()
	write(t, w, "b1")
	write(t, w, "a2")
	if err := w.uncork(time.Time{}); err != nil {
		t.Fatal(err)
	}
	write(t, w, "b2")
	if got, want := strings.Join(sock.got(), "|"), "a1b1a2"; got != want {
		t.Fatalf("after the first uncork: %q, want %q", got, want)
	}
	if err := w.uncork(time.Time{}); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(sock.got(), "|"), "a1b1a2|b2"; got != want {
		t.Fatalf("after the second uncork: %q, want %q", got, want)
	}
	if err := w.flush(); err != nil || len(sock.got()) != 2 {
		t.Fatalf("a flush with nothing gathered wrote: %q, %v", sock.got(), err)
	}
}

// A large batch does not wait for its end: its first messages leave once
// wireFlushAt bytes are gathered.
func TestWireWritesAtItsThreshold(t *testing.T) {
	t.Parallel()
	sock := &socket{}
	w := &wire{Conn: sock}
	w.cork()
	msg := strings.Repeat("x", 1000)
	for range wireFlushAt / len(msg) {
		write(t, w, msg)
	}
	if n := len(sock.got()); n != 0 {
		t.Fatalf("%d writes below the threshold", n)
	}
	write(t, w, msg)
	got := sock.got()
	if len(got) != 1 || len(got[0]) != (wireFlushAt/len(msg)+1)*len(msg) {
		t.Fatalf("at the threshold: %d writes", len(got))
	}
	write(t, w, "tail")
	if err := w.uncork(time.Time{}); err != nil {
		t.Fatal(err)
	}
	if got := sock.got(); len(got) != 2 || got[1] != "tail" {
		t.Fatalf("after uncork: %d writes", len(got))
	}
}

// The client believes gathered bytes sent. When they cannot be written, the
// connection must end, so that the client's reader fails and every confirm
// it awaits ends as not acked; and nothing is written after.
func TestWireFailedWriteEndsTheConnection(t *testing.T) {
	t.Parallel()
	sock := &socket{}
	w := &wire{Conn: sock}
	w.cork()
	write(t, w, "a")
	broken := errors.New("broken pipe")
	sock.fail = broken
	if err := w.uncork(time.Time{}); !errors.Is(err, broken) {
		t.Fatalf("uncork = %v, want the write's error", err)
	}
	if !sock.closed {
		t.Fatal("a failed write of gathered bytes left the socket open")
	}
	sock.fail = nil
	if _, err := w.Write([]byte("b")); !errors.Is(err, broken) {
		t.Fatalf("a write after the failure = %v, want %v", err, broken)
	}
	if got := sock.got(); len(got) != 0 {
		t.Fatalf("written after the failure: %q", got)
	}
}

// On a real broker: a batch of 500 leaves in a handful of writes (not one
// per message), and arrives whole and in order.
func TestABatchLeavesInAFewWrites(t *testing.T) {
	t.Parallel()
	ch, exchange := returnsExchange(t)
	queue := boundQueue(t, ch, exchange, "#")
	p, err := NewPublisher(Config{URL: outboxtest.AMQPURL(), Exchange: exchange})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}

	const n = 500
	payload := []byte(`{"pad":"` + strings.Repeat("x", 300) + `"}`)
	msgs := make([]outbox.Envelope, n)
	created := time.Now()
	for i := range msgs {
		msgs[i] = outbox.Envelope{ID: int64(i + 1), AggregateType: "order", AggregateID: "a", AggregateVersion: int64(i + 1),
			EventType: "order.created", Payload: payload, Headers: map[string]string{"traceparent": "00-x"}, CreatedAt: created}
	}
	w := p.conn.Load().wire
	before := w.socketWrites()
	for i, err := range p.PublishBatch(ctx, msgs) {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	// About 250 kB: four writes at the threshold and the rest at the end. A
	// heartbeat may add one.
	limit := int64(n*(len(payload)+200)/wireFlushAt + 3)
	if writes := w.socketWrites() - before; writes > limit {
		t.Fatalf("%d messages took %d socket writes, want at most %d", n, writes, limit)
	}

	deliveries, err := ch.Consume(queue, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		select {
		case d := <-deliveries:
			if want := outbox.MessageID(int64(i+1), created); d.MessageId != want || !bytes.Equal(d.Body, payload) {
				t.Fatalf("delivery %d: message %s (%d bytes), want message %s", i, d.MessageId, len(d.Body), want)
			}
		case <-ctx.Done():
			t.Fatalf("%d of %d messages arrived", i, n)
		}
	}
}

// A batch that ends past its deadline still writes what it gathered, but a
// broker that stopped reading must not keep it there: the write is bounded,
// and its failure ends the connection.
func TestWireUncorkPastTheDeadlineIsBounded(t *testing.T) {
	t.Parallel()
	client, broker := net.Pipe() // nobody reads broker: every write blocks
	defer broker.Close()
	w := &wire{Conn: client}
	w.cork()
	write(t, w, "a")
	done := make(chan error, 1)
	go func() { done <- w.uncork(time.Now().Add(100 * time.Millisecond)) }()
	select {
	case err := <-done:
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("uncork = %v, want a write timeout", err)
		}
	case <-time.After(10 * time.Second):
		_ = client.Close()
		t.Fatal("uncork with a deadline stayed stuck on a peer that reads nothing")
	}
	if _, err := client.Write([]byte("b")); !errors.Is(err, io.ErrClosedPipe) {
		t.Fatalf("after the stuck write the socket is still open: %v", err)
	}
}

package outboxamqp

import (
	"net"
	"sync"
	"time"
)

// wireFlushAt is how many bytes a corked wire gathers before it writes them
// anyway: about 150 messages of a few hundred bytes, so the first messages
// of a large batch reach the broker while the rest are still being framed.
const wireFlushAt = 64 << 10

// wire is the socket under the AMQP client, with a cork.
//
// amqp091-go writes each publish to the socket on its own (it flushes its
// buffer after every message): one write system call per message, and as
// many reads on the broker's side. While a batch is corked, the client's
// writes are gathered here instead and reach the socket when the batch has
// been framed (uncork), or every wireFlushAt bytes, or before the batch
// waits for the broker to unblock it. A batch of 500 messages becomes a few
// writes.
//
// Nothing here decides what is published: a message counts as published only
// on the broker's confirm, which cannot come before its bytes were written.
// A write that fails while corked fails the connection (the socket is
// closed), so the batch's confirms end as not acked, outcome unknown, as for
// any connection lost in flight.
//
// Corks nest: two batches on two channels of one connection may overlap. An
// uncork writes everything gathered so far, the other batch's frames
// included (bytes leave in the order the client wrote them, whole frames or
// not), and the rest stays corked until the other batch uncorks too.
type wire struct {
	net.Conn

	mu     sync.Mutex
	corks  int
	buf    []byte
	err    error // the first write that failed: every later one fails with it
	writes int64 // to the socket, failed ones included
}

// Write is the client's write: straight to the socket when no batch is
// corked, gathered otherwise. It runs under the client's send lock.
func (w *wire) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err != nil {
		return 0, w.err
	}
	if w.corks == 0 { // nothing is gathered then: every uncork writes it all
		w.writes++
		n, err := w.Conn.Write(p)
		if err != nil {
			w.err = err
		}
		return n, err
	}
	w.buf = append(w.buf, p...)
	if len(w.buf) >= wireFlushAt {
		if err := w.flushLocked(); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// cork starts gathering the client's writes.
func (w *wire) cork() {
	w.mu.Lock()
	w.corks++
	w.mu.Unlock()
}

// uncork ends one cork and writes what was gathered. An error means the
// connection is lost: the socket is closed, so the client sees it too. A
// non-zero deadline bounds the write: a write stuck on a broker that stopped
// reading then fails at the deadline, and ends the connection.
func (w *wire) uncork(deadline time.Time) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.corks > 0 {
		w.corks--
	}
	if !deadline.IsZero() && len(w.buf) > 0 && w.err == nil {
		if err := w.Conn.SetWriteDeadline(deadline); err != nil {
			return w.failLocked(err)
		}
		defer func() { _ = w.Conn.SetWriteDeadline(time.Time{}) }()
	}
	return w.flushLocked()
}

// flush writes what was gathered, the cork left as it is.
func (w *wire) flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.flushLocked()
}

// socketWrites is how many writes reached the socket so far.
func (w *wire) socketWrites() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.writes
}

func (w *wire) flushLocked() error {
	if w.err != nil {
		return w.err
	}
	if len(w.buf) == 0 {
		return nil
	}
	w.writes++
	_, err := w.Conn.Write(w.buf)
	if cap(w.buf) > 4*wireFlushAt {
		w.buf = nil // a huge message passed through: do not keep its buffer
	} else {
		w.buf = w.buf[:0]
	}
	if err != nil {
		return w.failLocked(err)
	}
	return nil
}

// failLocked ends the connection: bytes the client believes sent are lost,
// so its reader must fail and every confirm pending on it end.
func (w *wire) failLocked(err error) error {
	w.err = err
	w.buf = nil
	_ = w.Conn.Close()
	return err
}

package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// brokerReader reads the shipping queues' counts for the live view, over one
// connection of its own kept between reads. A passive queue declare answers
// with a queue's ready messages (not those delivered and not yet acked) and
// its consumers, without the management plugin.
//
// A read is bounded by its context. The client library's calls have no
// context: a broker that stops answering once connected (the TCP connection
// stays up, nothing comes back) would hold a call, and with it the page's
// whole snapshot, for as long as TCP keeps the connection. When the context
// ends first, the reader closes the connection's socket under the call,
// which then fails and returns; the next read dials again.
type brokerReader struct {
	url string

	read sync.Mutex       // one read at a time, held for the whole read
	conn *amqp.Connection // guarded by read

	rawMu  sync.Mutex
	raw    net.Conn    // conn's socket: abort closes it
	broken atomic.Bool // set by abort: the next read dials again

	life     sync.Mutex
	closed   bool           // guarded by life: no read starts or dials
	inFlight sync.WaitGroup // the reads, including those abandoned by their caller
}

// queueCounts are the broker's side of the pipeline; nil is unknown.
type queueCounts struct {
	Ready, Consumers, Delay, DeadLetters *int64
}

var errReaderClosed = errors.New("the live view is stopping")

// brokerDialTimeout bounds a dial and the AMQP handshake.
const brokerDialTimeout = 2 * time.Second

func newBrokerReader(url string) *brokerReader { return &brokerReader{url: url} }

// counts reads the three queues. It returns when the read is done or when
// ctx ends, whichever comes first, with what it could read and an error
// naming what it could not.
func (b *brokerReader) counts(ctx context.Context) (queueCounts, error) {
	type result struct {
		c   queueCounts
		err error
	}
	b.life.Lock()
	if b.closed {
		b.life.Unlock()
		return queueCounts{}, errReaderClosed
	}
	b.inFlight.Add(1)
	b.life.Unlock()
	done := make(chan result, 1)
	go func() {
		defer b.inFlight.Done()
		c, err := b.readQueues()
		done <- result{c, err}
	}()
	select {
	case r := <-done:
		return r.c, r.err
	case <-ctx.Done():
		b.abort()
		return queueCounts{}, fmt.Errorf("no answer: %w", ctx.Err())
	}
}

func (b *brokerReader) readQueues() (queueCounts, error) {
	b.read.Lock()
	defer b.read.Unlock()
	b.life.Lock()
	closed := b.closed
	b.life.Unlock()
	if closed {
		return queueCounts{}, errReaderClosed
	}
	if b.conn == nil || b.conn.IsClosed() || b.broken.Swap(false) {
		if b.conn != nil {
			_ = b.conn.CloseDeadline(time.Now())
		}
		c, err := amqp.DialConfig(b.url, amqp.Config{
			Dial:       b.dial,
			Properties: amqp.Table{"connection_name": "demo live view"},
		})
		if err != nil {
			b.conn = nil
			return queueCounts{}, fmt.Errorf("connect: %w", err)
		}
		b.conn = c
	}
	var out queueCounts
	var problems []string
	for _, q := range []struct {
		name            string
		msgs, consumers **int64
	}{
		{mainQueue, &out.Ready, &out.Consumers},
		{delayQueue, &out.Delay, nil},
		{dlq, &out.DeadLetters, nil},
	} {
		ch, err := b.conn.Channel()
		if err != nil {
			problems = append(problems, "open a channel: "+err.Error())
			break
		}
		info, err := ch.QueueDeclarePassive(q.name, true, false, false, false, nil)
		if err != nil {
			// The broker closed the channel (a missing queue, say).
			problems = append(problems, "queue "+q.name+": "+err.Error())
			continue
		}
		_ = ch.Close()
		msgs, consumers := int64(info.Messages), int64(info.Consumers)
		*q.msgs = &msgs
		if q.consumers != nil {
			*q.consumers = &consumers
		}
	}
	if len(problems) > 0 {
		return out, fmt.Errorf("%s", strings.Join(problems, "; "))
	}
	return out, nil
}

// dial is DefaultDial's (a deadline on the dial and the handshake) keeping
// the socket for abort.
func (b *brokerReader) dial(network, addr string) (net.Conn, error) {
	c, err := amqp.DefaultDial(brokerDialTimeout)(network, addr)
	if err != nil {
		return nil, err
	}
	b.rawMu.Lock()
	b.raw = c
	b.rawMu.Unlock()
	return c, nil
}

// abort closes the socket under a read that did not return in time.
func (b *brokerReader) abort() {
	b.broken.Store(true)
	b.rawMu.Lock()
	defer b.rawMu.Unlock()
	if b.raw != nil {
		_ = b.raw.Close()
	}
}

// close closes the connection (gracefully unless a read holds it) and waits
// for every read to return.
func (b *brokerReader) close() {
	b.life.Lock()
	b.closed = true
	b.life.Unlock()
	if !b.read.TryLock() {
		b.abort() // a read holds the connection: make it return
		b.read.Lock()
	}
	if b.conn != nil {
		_ = b.conn.CloseDeadline(time.Now().Add(time.Second))
		b.conn = nil
	}
	b.read.Unlock()
	b.inFlight.Wait()
}

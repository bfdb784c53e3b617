package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// hangingBroker is a TCP proxy to a RabbitMQ node that can make it hang as
// a broker does whose connection is alive but whose operations never
// complete (a quorum queue without a leader, say): hung, it still forwards
// the heartbeat frames from the broker, and everything from the client, but
// holds every other frame from the broker until it is released. The
// client's heartbeat checks are satisfied, so only a deadline of the
// client's own ends a call.
type hangingBroker struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	cond   *sync.Cond
	hung   bool
	closed bool
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newHangingBroker(t *testing.T, target string) *hangingBroker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &hangingBroker{ln: ln, target: target}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *hangingBroker) addr() string { return p.ln.Addr().String() }

func (p *hangingBroker) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		broker, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = client.Close()
			_ = broker.Close()
			return
		}
		p.conns = append(p.conns, client, broker)
		p.mu.Unlock()
		p.wg.Go(func() {
			_, _ = io.Copy(broker, client)
			_ = broker.Close()
			_ = client.Close()
		})
		p.wg.Go(func() { p.fromBroker(client, broker) })
	}
}

// fromBroker forwards the broker's frames (AMQP 0-9-1: type, channel, size,
// payload, end octet) to the client, holding all but heartbeats while hung.
func (p *hangingBroker) fromBroker(client, broker net.Conn) {
	defer func() { _ = client.Close(); _ = broker.Close() }()
	var (
		queue [][]byte
		ended bool
	)
	p.wg.Go(func() { // the reader: frames into queue
		defer func() {
			p.mu.Lock()
			ended = true
			p.cond.Broadcast()
			p.mu.Unlock()
		}()
		r := bufio.NewReader(broker)
		for {
			head := make([]byte, 7)
			if _, err := io.ReadFull(r, head); err != nil {
				return
			}
			frame := make([]byte, 7+int(binary.BigEndian.Uint32(head[3:]))+1)
			copy(frame, head)
			if _, err := io.ReadFull(r, frame[7:]); err != nil {
				return
			}
			p.mu.Lock()
			queue = append(queue, frame)
			p.cond.Broadcast()
			p.mu.Unlock()
		}
	})
	const heartbeat = 8
	for {
		p.mu.Lock()
		var out [][]byte
		for len(out) == 0 && !ended && !p.closed {
			if !p.hung {
				out, queue = queue, nil
			} else {
				kept := queue[:0:0]
				for _, f := range queue {
					if f[0] == heartbeat {
						out = append(out, f)
					} else {
						kept = append(kept, f)
					}
				}
				queue = kept
			}
			if len(out) == 0 {
				p.cond.Wait()
			}
		}
		stop := len(out) == 0
		p.mu.Unlock()
		if stop {
			return
		}
		for _, f := range out {
			if _, err := client.Write(f); err != nil {
				return
			}
		}
	}
}

func (p *hangingBroker) set(hung bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hung = hung
	p.cond.Broadcast()
}

func (p *hangingBroker) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	p.closed = true
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.cond.Broadcast()
	p.mu.Unlock()
	p.wg.Wait()
}

// A broker that stops answering once connected does not freeze the live
// view: its snapshot goes on, with the queue counts unknown and the broker's
// error on the status line, and the counts come back when the broker does.
// Also, a queue the broker does not have is an error on the status line, not
// a silent blank. The broker is this machine's RabbitMQ (a vhost of the
// test's own) behind a hangingBroker, which keeps its heartbeats flowing:
// the client library alone would wait forever. The stores and the services
// are on closed ports.
func TestLiveViewSurvivesAHungBroker(t *testing.T) {
	if testing.Short() {
		t.Skip("talks to RabbitMQ")
	}
	t.Parallel()
	direct := demoVhost(t)
	u, _ := url.Parse(direct)
	proxy := newHangingBroker(t, u.Host)
	u.Host = proxy.addr()
	closed := freeTestAddr(t)
	cfg := config{
		DatabaseURL: "postgres://postgres@" + closed + "/nothing?sslmode=disable&connect_timeout=1",
		AMQPURL:     u.String(),
		MongoURI:    "mongodb://" + closed + "/shipping",
		OrdersAddr:  closed, ShippingAddr: closed,
		UIAddr: freeTestAddr(t),
	}
	out := &syncBuffer{}
	d := newDemo(cfg, out)
	d.ctl = &localController{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	v, err := startLiveView(ctx, d)
	if err != nil {
		t.Fatal(err)
	}
	closeView := sync.OnceValue(v.close)
	t.Cleanup(func() {
		stopped := make(chan error, 1)
		go func() { stopped <- closeView() }()
		select {
		case <-stopped:
		case <-time.After(time.Minute):
			t.Error("the live view did not stop within a minute")
		}
	})
	base := "http://" + cfg.UIAddr
	var st snapshot
	waitState := func(what string, cond func(snapshot) bool) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for st = state(t, base); !cond(st); st = state(t, base) {
			if time.Now().After(deadline) {
				t.Fatalf("the live view never showed %s; last reading at %s: stages %+v, errors %v",
					what, st.At.Format(time.RFC3339Nano), st.Stages, st.Errors)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// No shipping queues in the vhost yet.
	waitState("the missing queue on the status line", func(s snapshot) bool {
		return strings.Contains(s.Errors["broker"], "queue "+mainQueue) && strings.Contains(s.Errors["broker"], "NOT_FOUND")
	})
	if st.Stages.QueueReady != nil {
		t.Fatalf("queue_ready = %d for a queue that does not exist", *st.Stages.QueueReady)
	}
	declareShippingQueues(t, direct)
	waitState("the queue counts", func(s snapshot) bool {
		return s.Stages.QueueReady != nil && s.Stages.DelayQueue != nil && s.Stages.DeadLetterQueue != nil && s.Errors["broker"] == ""
	})

	// The broker stops answering.
	proxy.set(true)
	since := time.Now()
	waitState("a reading after the broker hung", func(s snapshot) bool { return s.At.After(since) })
	if st.Stages.QueueReady != nil || st.Errors["broker"] == "" {
		t.Fatalf("a reading of a hung broker: queue_ready %v, broker error %q; want unknown, and an error", st.Stages.QueueReady, st.Errors["broker"])
	}
	t.Logf("hung broker: %s", st.Errors["broker"])
	hungAt := st.At
	waitState("the readings going on", func(s snapshot) bool { return s.At.After(hungAt) })
	if st.Errors["broker"] == "" {
		t.Fatalf("a later reading of the hung broker has no broker error")
	}

	// It answers again.
	proxy.set(false)
	waitState("the queue counts back", func(s snapshot) bool {
		return s.Stages.QueueReady != nil && s.Errors["broker"] == ""
	})

	// The live view stops while the broker hangs, with a read in flight
	// whose caller set no deadline: both return.
	proxy.set(true)
	read := make(chan error, 1)
	go func() {
		_, err := v.broker.counts(context.Background())
		read <- err
	}()
	stopped := make(chan error, 1)
	go func() { stopped <- closeView() }()
	select {
	case err := <-stopped:
		if err != nil {
			t.Errorf("close: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the live view did not stop while the broker hangs")
	}
	select {
	case err := <-read:
		if err == nil {
			t.Error("a read of the hung broker succeeded")
		}
	case <-time.After(time.Minute):
		t.Fatal("a read of the hung broker did not return when the live view stopped")
	}
}

// declareShippingQueues declares the three queues the live view reads, as
// plain queues (their arguments do not matter to a passive declare).
func declareShippingQueues(t *testing.T, amqpURL string) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{mainQueue, delayQueue, dlq} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
}

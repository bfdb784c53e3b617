package rabbitmq_test

import (
	"bufio"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// publishProxy forwards TCP connections to an AMQP broker, frame by frame.
// Armed, it stops forwarding what the broker sends on a connection once the
// client published on it, heartbeats apart: the broker takes the message,
// looks alive, and its confirm never reaches the client, as when a broker
// under a resource alarm holds a publish.
type publishProxy struct {
	ln       net.Listener
	target   string
	armed    atomic.Bool
	accepted atomic.Int32
	wg       sync.WaitGroup
}

func newPublishProxy(t *testing.T, amqpURL string) (*publishProxy, string) {
	t.Helper()
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &publishProxy{ln: ln, target: u.Host}
	p.wg.Go(p.serve)
	t.Cleanup(func() { _ = ln.Close(); p.wg.Wait() })
	u.Host = ln.Addr().String()
	return p, u.String()
}

func (p *publishProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		p.wg.Go(func() { p.pipe(c) })
	}
}

func (p *publishProxy) pipe(c net.Conn) {
	defer c.Close()
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer up.Close()
	var published atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer c.Close()
		r := bufio.NewReader(up)
		hdr := make([]byte, 7)
		for {
			if _, err := io.ReadFull(r, hdr); err != nil {
				return
			}
			body := make([]byte, binary.BigEndian.Uint32(hdr[3:])+1)
			if _, err := io.ReadFull(r, body); err != nil {
				return
			}
			// Heartbeats (frame type 8) still pass: the broker looks alive.
			if published.Load() && hdr[0] != 8 {
				continue
			}
			if _, err := c.Write(append(hdr, body...)); err != nil {
				return
			}
		}
	}()
	// Client to broker: the protocol header, then frames (type, channel,
	// size, payload, end byte); a method frame's payload starts with its
	// class and method ids, basic.publish being 60/40. A frame goes on to the
	// broker only once it is parsed, so the flag is set before the broker can
	// confirm the publish.
	r := bufio.NewReader(c)
	proto := make([]byte, 8)
	if _, err := io.ReadFull(r, proto); err == nil {
		if _, err := up.Write(proto); err == nil {
			hdr := make([]byte, 7)
			for {
				if _, err := io.ReadFull(r, hdr); err != nil {
					break
				}
				body := make([]byte, binary.BigEndian.Uint32(hdr[3:])+1)
				if _, err := io.ReadFull(r, body); err != nil {
					break
				}
				if hdr[0] == 1 && len(body) >= 4 && binary.BigEndian.Uint16(body) == 60 && binary.BigEndian.Uint16(body[2:]) == 40 && p.armed.Load() {
					published.Store(true)
				}
				if _, err := up.Write(append(hdr, body...)); err != nil {
					break
				}
			}
		}
	}
	_ = up.Close()
	<-done
}

// A re-publish whose confirm never comes fails after ConfirmTimeout, even
// when the caller's context has no deadline (a release run at start, an
// operator's request without one), and the next one succeeds on a fresh
// connection.
func TestRepublishGivesUpWhenTheConfirmNeverComes(t *testing.T) {
	t.Parallel()
	broker, _ := amqptest.Queue(t, "q")
	proxy, viaProxy := newPublishProxy(t, broker)
	pub := &rabbitmq.ReplayPublisher{URL: viaProxy, Queue: "q", ConfirmTimeout: 2 * time.Second}
	t.Cleanup(func() { _ = pub.Close() })

	proxy.armed.Store(true)
	errc := make(chan error, 1)
	go func() { errc <- pub.Publish(t.Context(), shipment.KeptMessage{MessageID: "m-1", Body: []byte("{}")}) }()
	select {
	case err := <-errc:
		if err == nil {
			t.Fatal("Publish succeeded though its confirm never reached it")
		}
		t.Logf("Publish failed as it should: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("Publish still waits for a confirm 20s later (ConfirmTimeout 2s)")
	}

	proxy.armed.Store(false)
	if err := pub.Publish(t.Context(), shipment.KeptMessage{MessageID: "m-2", Body: []byte("{}")}); err != nil {
		t.Fatalf("Publish after the stalled one: %v", err)
	}
}

// Releasing an order re-publishes its parked messages one after the other:
// on one connection, not one per message.
func TestRepublisherKeepsItsConnection(t *testing.T) {
	t.Parallel()
	broker, ch := amqptest.Queue(t, "q")
	proxy, viaProxy := newPublishProxy(t, broker)
	pub := &rabbitmq.ReplayPublisher{URL: viaProxy, Queue: "q"}
	t.Cleanup(func() { _ = pub.Close() })

	const n = 5
	for i := range n {
		if err := pub.Publish(t.Context(), shipment.KeptMessage{MessageID: "m-" + string(rune('a'+i)), Body: []byte("{}")}); err != nil {
			t.Fatal(err)
		}
	}
	if got := proxy.accepted.Load(); got != 1 {
		t.Fatalf("%d messages re-published over %d connections, want 1", n, got)
	}
	q, err := ch.QueueDeclarePassive("q", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if q.Messages != n {
		t.Fatalf("queue holds %d messages, want %d", q.Messages, n)
	}
	if err := pub.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Close: %v", err)
	}
}

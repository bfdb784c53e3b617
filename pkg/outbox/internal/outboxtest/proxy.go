package outboxtest

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
)

// Proxy is a TCP forwarder between a client and a server (a publisher and
// the broker, a relay and PostgreSQL) that a test can stop (every connection
// cut, nothing listening), start again on the same address, point at
// another server, and make swallow the server's replies. Every goroutine it starts is
// tracked, and Stop returns only once they have all ended, so a test leaves
// nothing running behind it.
//
// It replaces an in-process toxiproxy, whose Stop returns while the
// goroutines of its links are still winding down and whose removal of a
// "timeout" toxic from a live link can leave the link's first stage blocked
// on a channel nobody reads: goleak then reported a toxiproxy goroutine now
// and then, depending on timing.
type Proxy struct {
	amqpURL  string
	upstream string
	drop     atomic.Bool // swallow what the broker sends
	accepted atomic.Int64

	mu    sync.Mutex
	addr  string       // the listening address, fixed by the first Start
	ln    net.Listener // nil while stopped
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// NewProxy starts a Proxy in front of the broker at amqpURL, stopped when the
// test ends.
func NewProxy(t testing.TB, amqpURL string) *Proxy {
	t.Helper()
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "5672")
	}
	p := NewTCPProxy(t, host)
	p.amqpURL = amqpURL
	return p
}

// NewTCPProxy starts a Proxy in front of upstream (host:port), stopped when
// the test ends.
func NewTCPProxy(t testing.TB, upstream string) *Proxy {
	t.Helper()
	p := &Proxy{upstream: upstream, addr: "127.0.0.1:0", conns: map[net.Conn]struct{}{}}
	if err := p.Start(); err != nil {
		t.Fatalf("start proxy: %v", err)
	}
	t.Cleanup(p.Stop)
	return p
}

// Addr is the proxy's listening address.
func (p *Proxy) Addr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addr
}

// SetUpstream points the proxy at another server, as a switchover does to a
// service's address: new connections reach upstream, open ones stay where
// they are (CutAll cuts them).
func (p *Proxy) SetUpstream(upstream string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.upstream = upstream
}

// Accepted counts the connections the proxy accepted since it was made.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// CutAll closes every open connection; the proxy keeps listening.
func (p *Proxy) CutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
}

// Start listens (again) on the proxy's address.
func (p *Proxy) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		return errors.New("proxy already started")
	}
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		return fmt.Errorf("proxy listen: %w", err)
	}
	p.ln, p.addr = ln, ln.Addr().String()
	p.wg.Go(func() { p.accept(ln) })
	return nil
}

// Stop closes the listener and every connection, and waits for the proxy's
// goroutines to end.
func (p *Proxy) Stop() {
	p.mu.Lock()
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// DropReplies makes the proxy swallow (or, with false, pass again) what the
// broker sends.
func (p *Proxy) DropReplies(on bool) { p.drop.Store(on) }

func (p *Proxy) accept(ln net.Listener) {
	for {
		client, err := ln.Accept()
		if err != nil {
			return // closed by Stop
		}
		p.accepted.Add(1)
		p.mu.Lock()
		upstream := p.upstream
		p.mu.Unlock()
		broker, err := net.Dial("tcp", upstream)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		if p.ln != ln { // stopped meanwhile
			p.mu.Unlock()
			_ = client.Close()
			_ = broker.Close()
			return
		}
		p.conns[client], p.conns[broker] = struct{}{}, struct{}{}
		p.wg.Add(2) // this goroutine is counted, so Stop's Wait cannot have returned
		p.mu.Unlock()
		go p.pipe(broker, client, nil)
		go p.pipe(client, broker, &p.drop)
	}
}

// pipe copies src to dst (unless drop is set) until either fails, then closes
// both: one side ending ends the connection, as a cut would.
func (p *Proxy) pipe(dst, src net.Conn, drop *atomic.Bool) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && (drop == nil || !drop.Load()) {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	_ = src.Close()
	_ = dst.Close()
	p.mu.Lock()
	delete(p.conns, src)
	delete(p.conns, dst)
	p.mu.Unlock()
}

// URL is the test broker's URL through the proxy.
func (p *Proxy) URL(t testing.TB) string {
	u, err := url.Parse(p.amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	u.Host = p.addr
	p.mu.Unlock()
	return u.String()
}

// Connections counts the client connections open through the proxy (each
// has its broker side in conns too).
func (p *Proxy) Connections() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns) / 2
}

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// toxi is an embedded toxiproxy: TCP proxies on 127.0.0.1 between the
// services and what they depend on, with faults on demand. It runs inside the
// test process (no toxiproxy server to install); its HTTP API is not started.
type toxi struct {
	srv *toxiproxy.ApiServer

	mu      sync.Mutex
	proxies map[string]*toxiproxy.Proxy
	toxics  map[string][]string // proxy name -> toxic names
	// down counts, per proxy, the faults holding it disabled: faults drawn
	// independently may overlap on one proxy, and it comes back when the
	// last of them heals.
	down map[string]int
}

func newToxi() *toxi {
	return &toxi{
		srv:     toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop()),
		proxies: make(map[string]*toxiproxy.Proxy),
		toxics:  make(map[string][]string),
		down:    make(map[string]int),
	}
}

// add starts a proxy to upstream on a free loopback port and returns its
// address.
func (x *toxi) add(name, upstream string) (string, error) {
	p := toxiproxy.NewProxy(x.srv, name, "127.0.0.1:0", upstream)
	if err := x.srv.Collection.Add(p, true); err != nil {
		return "", fmt.Errorf("toxiproxy: add %s: %w", name, err)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.proxies[name] = p
	return p.Listen, nil
}

func (x *toxi) proxy(name string) (*toxiproxy.Proxy, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	p, ok := x.proxies[name]
	if !ok {
		return nil, fmt.Errorf("toxiproxy: no proxy %q", name)
	}
	return p, nil
}

// disable closes every connection through the proxy and refuses new ones,
// until every disable is matched by an enable.
func (x *toxi) disable(name string) error {
	p, err := x.proxy(name)
	if err != nil {
		return err
	}
	x.mu.Lock()
	x.down[name]++
	x.mu.Unlock()
	p.Stop()
	return nil
}

// enable lets connections through again, on the same port, once no other
// fault holds the proxy disabled.
func (x *toxi) enable(name string) error {
	p, err := x.proxy(name)
	if err != nil {
		return err
	}
	x.mu.Lock()
	x.down[name] = max(x.down[name]-1, 0)
	held := x.down[name] > 0
	x.mu.Unlock()
	if held {
		return nil
	}
	p.Lock()
	enabled := p.Enabled
	p.Unlock()
	if enabled {
		return nil
	}
	if err := p.Start(); err != nil {
		return fmt.Errorf("toxiproxy: enable %s: %w", name, err)
	}
	return nil
}

// setUpstream points the proxy at a new address (a restarted container's new
// port), cutting the connections to the old one.
func (x *toxi) setUpstream(name, upstream string) error {
	p, err := x.proxy(name)
	if err != nil {
		return err
	}
	p.Lock()
	in := &toxiproxy.Proxy{Listen: p.Listen, Upstream: upstream, Enabled: p.Enabled}
	p.Unlock()
	if err := p.Update(in); err != nil {
		return fmt.Errorf("toxiproxy: point %s at %s: %w", name, upstream, err)
	}
	return nil
}

// addToxic adds a toxic of typ (latency, timeout, reset_peer, ...) on the
// stream ("upstream" or "downstream") with its attributes.
func (x *toxi) addToxic(name, toxic, typ, stream string, attrs map[string]any) error {
	p, err := x.proxy(name)
	if err != nil {
		return err
	}
	b, err := json.Marshal(map[string]any{"name": toxic, "type": typ, "stream": stream, "toxicity": 1.0, "attributes": attrs})
	if err != nil {
		return fmt.Errorf("toxiproxy: encode toxic: %w", err)
	}
	if _, err := p.Toxics.AddToxicJson(strings.NewReader(string(b))); err != nil {
		return fmt.Errorf("toxiproxy: add %s toxic to %s: %w", typ, name, err)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.toxics[name] = append(x.toxics[name], toxic)
	return nil
}

// removeToxic removes a toxic; removing one that is gone is not an error.
func (x *toxi) removeToxic(ctx context.Context, name, toxic string) error {
	p, err := x.proxy(name)
	if err != nil {
		return err
	}
	x.mu.Lock()
	names := x.toxics[name]
	for i, n := range names {
		if n == toxic {
			x.toxics[name] = append(names[:i:i], names[i+1:]...)
			break
		}
	}
	x.mu.Unlock()
	if p.Toxics.GetToxic(toxic) == nil {
		return nil
	}
	return x.withoutConnections(name, p, func() error {
		if err := p.Toxics.RemoveToxic(ctx, toxic); err != nil {
			return fmt.Errorf("toxiproxy: remove toxic %s from %s: %w", toxic, name, err)
		}
		return nil
	})
}

// withoutConnections runs change (a toxic removed) on proxy p with no
// connection through it: it cuts them first, and lets clients in again after.
// Toxiproxy removes a toxic from each live connection under the lock that new
// connections also take, and deadlocks when one of them closes at that moment
// (a broker restart during a latency toxic: Shopify/toxiproxy#558); the proxy
// then accepts nobody for minutes. So a toxic ends with a cut.
func (x *toxi) withoutConnections(name string, p *toxiproxy.Proxy, change func() error) error {
	p.Lock()
	enabled := p.Enabled
	p.Unlock()
	if enabled {
		p.Stop()
		// Each connection's writer leaves the proxy's lists once its
		// sockets are closed, which takes well under this.
		time.Sleep(250 * time.Millisecond)
	}
	err := change()
	if enabled {
		err = errors.Join(err, x.enable(name))
	}
	return err
}

// heal removes every toxic and enables every proxy.
func (x *toxi) heal(ctx context.Context) error {
	x.mu.Lock()
	names := make([]string, 0, len(x.proxies))
	for n := range x.proxies {
		names = append(names, n)
	}
	x.mu.Unlock()
	var errs []error
	for _, n := range names {
		p, _ := x.proxy(n)
		if len(p.Toxics.GetToxicArray()) > 0 {
			errs = append(errs, x.withoutConnections(n, p, func() error {
				p.Toxics.ResetToxics(ctx)
				return nil
			}))
		}
		x.mu.Lock()
		x.toxics[n] = nil
		x.mu.Unlock()
		if err := x.enable(n); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// close stops every proxy and closes their connections.
func (x *toxi) close() {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, p := range x.proxies {
		p.Stop()
	}
	_ = x.srv.Collection.Clear()
}

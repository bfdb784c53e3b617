package config

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Tracing is the orders service's tracing settings beyond the standard
// OTEL_* variables (internal/tracing reads those).
type Tracing struct {
	// TrustedPeers is TRACE_TRUSTED_PEERS: the clients of the public API
	// whose traceparent and baggage are believed. A trusted client's context
	// is the parent of the request's server span and its baggage travels
	// with the events (within BaggageKeys); an untrusted client's request
	// starts a new trace, linked to the context it sent, and its baggage is
	// dropped. "all", "none", or a comma-separated list of addresses and
	// CIDR prefixes of the connection's peer (behind a proxy, the proxy).
	// Default: loopback (127.0.0.0/8, ::1).
	TrustedPeers PeerSet
	// BaggageKeys is TRACE_BAGGAGE_KEYS: the baggage members stored with
	// the events (and so sent to their consumers), comma-separated. Default:
	// none (no baggage is stored).
	BaggageKeys []string
	// BaggageMaxBytes is TRACE_BAGGAGE_MAX_BYTES: the stored baggage's
	// largest encoded size; members past it are dropped. Default: 512.
	BaggageMaxBytes int
	// DatabaseSpans is TRACE_DB: a CLIENT span for every PostgreSQL
	// statement (the claim, the mark, the inserts), under whatever span is
	// current. Default: false (a span per statement costs more than the
	// flow's own spans).
	DatabaseSpans bool
}

// PeerSet is a set of client addresses.
type PeerSet struct {
	all      bool
	prefixes []netip.Prefix
}

// AllPeers is the set of every address.
func AllPeers() PeerSet { return PeerSet{all: true} }

// Contains reports whether addr (an IP, or IP:port as in
// http.Request.RemoteAddr) is in the set.
func (s PeerSet) Contains(addr string) bool {
	if s.all {
		return true
	}
	ap, err := netip.ParseAddrPort(addr)
	ip := ap.Addr()
	if err != nil {
		if ip, err = netip.ParseAddr(addr); err != nil {
			return false
		}
	}
	ip = ip.Unmap()
	for _, p := range s.prefixes {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// String lists the set as TRACE_TRUSTED_PEERS would.
func (s PeerSet) String() string {
	if s.all {
		return "all"
	}
	if len(s.prefixes) == 0 {
		return "none"
	}
	parts := make([]string, len(s.prefixes))
	for i, p := range s.prefixes {
		parts[i] = p.String()
	}
	return strings.Join(parts, ",")
}

// parsePeers reads TRACE_TRUSTED_PEERS.
func parsePeers(v string) (PeerSet, error) {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "":
		return PeerSet{prefixes: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}}, nil
	case "all":
		return AllPeers(), nil
	case "none":
		return PeerSet{}, nil
	}
	var s PeerSet
	for part := range strings.SplitSeq(v, ",") {
		part = strings.TrimSpace(part)
		p, err := netip.ParsePrefix(part)
		if err != nil {
			ip, ierr := netip.ParseAddr(part)
			if ierr != nil {
				return PeerSet{}, fmt.Errorf("TRACE_TRUSTED_PEERS=%q: %q is no address or CIDR prefix (want all, none, or a list such as 10.0.0.0/8,192.168.1.7)", v, part)
			}
			p = netip.PrefixFrom(ip, ip.BitLen())
		}
		s.prefixes = append(s.prefixes, p.Masked())
	}
	return s, nil
}

// tracingFromEnv reads the Tracing settings.
func tracingFromEnv(getenv func(string) string) (Tracing, error) {
	var t Tracing
	var err error
	if t.TrustedPeers, err = parsePeers(getenv("TRACE_TRUSTED_PEERS")); err != nil {
		return t, err
	}
	for k := range strings.SplitSeq(getenv("TRACE_BAGGAGE_KEYS"), ",") {
		if k = strings.TrimSpace(k); k != "" {
			t.BaggageKeys = append(t.BaggageKeys, k)
		}
	}
	t.BaggageMaxBytes = 512
	if v := strings.TrimSpace(getenv("TRACE_BAGGAGE_MAX_BYTES")); v != "" {
		if t.BaggageMaxBytes, err = strconv.Atoi(v); err != nil || t.BaggageMaxBytes < 1 {
			return t, fmt.Errorf("TRACE_BAGGAGE_MAX_BYTES=%q: want a positive number of bytes", v)
		}
	}
	if t.DatabaseSpans, err = boolVar(getenv, "TRACE_DB", false); err != nil {
		return t, err
	}
	return t, nil
}

package config

import (
	"slices"
	"strings"
	"testing"
)

func TestTracingFromEnv(t *testing.T) {
	t.Parallel()
	get := func(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }
	c, err := FromEnv(get(nil))
	if err != nil {
		t.Fatal(err)
	}
	if c.Tracing.BaggageKeys != nil || c.Tracing.BaggageMaxBytes != 512 || c.Tracing.DatabaseSpans || c.Tracing.TrustedPeers.String() != "127.0.0.0/8,::1/128" {
		t.Errorf("defaults: %+v (peers %s)", c.Tracing, c.Tracing.TrustedPeers)
	}
	c, err = FromEnv(get(map[string]string{"TRACE_BAGGAGE_KEYS": " tenant, ,region ", "TRACE_BAGGAGE_MAX_BYTES": "64", "TRACE_DB": "true"}))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Tracing.BaggageKeys, []string{"tenant", "region"}) || c.Tracing.BaggageMaxBytes != 64 || !c.Tracing.DatabaseSpans {
		t.Errorf("set: %+v", c.Tracing)
	}
	for _, kv := range []map[string]string{
		{"TRACE_TRUSTED_PEERS": "10.0.0.0/8,localhost"},
		{"TRACE_BAGGAGE_MAX_BYTES": "0"},
		{"TRACE_DB": "sometimes"},
	} {
		if _, err := FromEnv(get(kv)); err == nil {
			t.Errorf("%v: no error", kv)
		} else if k := strings.SplitN(strings.TrimSpace(keysOf(kv)), ",", 2)[0]; !strings.Contains(err.Error(), k) {
			t.Errorf("%v: error %q does not name %s", kv, err, k)
		}
	}
}

func keysOf(kv map[string]string) string {
	for k := range kv {
		return k
	}
	return ""
}

func TestTrustedPeers(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		set, addr string
		want      bool
	}{
		{"", "127.0.0.1:51234", true},
		{"", "[::1]:8080", true},
		{"", "10.1.2.3:80", false},
		{"", "[::ffff:127.0.0.1]:80", true},
		{"all", "203.0.113.9:443", true},
		{"none", "127.0.0.1:1", false},
		{"10.0.0.0/8, 192.168.1.7", "10.200.0.1:9", true},
		{"10.0.0.0/8, 192.168.1.7", "192.168.1.7:9", true},
		{"10.0.0.0/8, 192.168.1.7", "192.168.1.8:9", false},
		{"10.0.0.0/8", "garbage", false},
	} {
		s, err := parsePeers(c.set)
		if err != nil {
			t.Fatalf("%q: %v", c.set, err)
		}
		if got := s.Contains(c.addr); got != c.want {
			t.Errorf("peers %q contain %s = %v, want %v", c.set, c.addr, got, c.want)
		}
	}
}

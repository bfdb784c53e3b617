package e2e

import (
	"net"
	"testing"
	"time"
)

// Two faults that cut the same proxy may overlap (the chaos plan draws their
// times independently: two node_proxy_down on one node, or one inside a
// node_wipe). The proxy stays down until the last of them heals: the first
// heal must not let clients back while the second fault still holds it, or
// the second fault's check finds them on a node it cut (seen in a
// make chaos-cluster run: "clients never left the down nodes").
func TestToxiStaysDisabledUntilTheLastFaultHeals(t *testing.T) {
	t.Parallel()
	upstream, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer upstream.Close()
	go func() {
		for {
			c, err := upstream.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	x := newToxi()
	addr, err := x.add("overlap", upstream.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = x.disable("overlap") }()
	reachable := func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return false
		}
		_ = c.Close()
		return true
	}
	if !reachable() {
		t.Fatal("the proxy refuses connections before any fault")
	}
	for range 2 { // two faults take the proxy down
		if err := x.disable("overlap"); err != nil {
			t.Fatal(err)
		}
	}
	if err := x.enable("overlap"); err != nil { // the first heals
		t.Fatal(err)
	}
	if reachable() {
		t.Fatal("the first fault's heal let connections through while the second fault still holds the proxy down")
	}
	if err := x.enable("overlap"); err != nil { // the last heals
		t.Fatal(err)
	}
	if !reachable() {
		t.Fatal("the proxy refuses connections after every fault healed")
	}
	if err := x.enable("overlap"); err != nil { // one heal too many changes nothing
		t.Fatal(err)
	}
	if err := x.disable("overlap"); err != nil {
		t.Fatal(err)
	}
	if reachable() {
		t.Fatal("an extra heal made the next fault's disable count for nothing")
	}
}

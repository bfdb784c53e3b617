package rabbitmq

import (
	"fmt"
	"testing"
)

func TestLaneKeepsAnOrderOnOneWorkerAndSpreadsOrders(t *testing.T) {
	const n = 8
	used := make(map[int]bool)
	for i := range 200 {
		key := fmt.Sprintf("order-%d", i)
		first := Lane(key, n)
		if first < 0 || first >= n {
			t.Fatalf("Lane(%q, %d) = %d", key, n, first)
		}
		for range 5 {
			if l := Lane(key, n); l != first {
				t.Fatalf("%s went to lanes %d and %d", key, first, l)
			}
		}
		used[first] = true
	}
	if len(used) != n {
		t.Errorf("200 orders used %d lanes of %d", len(used), n)
	}
}

package inbox

import "sync"

// doneCache is a bounded, concurrency-safe set of the message ids this Inbox
// knows are done: their record was written (or the transaction holding it
// committed), or buffered after the handler succeeded, or a lookup found it.
// Done is final, so a hit is always right, even after retention purged the
// record. When full, the oldest id is evicted first. A nil *doneCache is a
// disabled cache: it holds nothing.
type doneCache struct {
	size int

	mu   sync.Mutex
	ids  map[string]struct{}
	ring []string // insertion order; grows up to size, then wraps at next
	next int      // the ring's oldest slot once it is full
}

func newDoneCache(size int) *doneCache {
	if size <= 0 {
		return nil
	}
	return &doneCache{size: size, ids: map[string]struct{}{}}
}

func (c *doneCache) contains(msgID string) bool {
	if c == nil {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.ids[msgID]
	return ok
}

func (c *doneCache) add(msgID string) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.ids[msgID]; ok {
		return
	}
	c.ids[msgID] = struct{}{}
	if len(c.ring) < c.size {
		c.ring = append(c.ring, msgID)
		return
	}
	delete(c.ids, c.ring[c.next])
	c.ring[c.next] = msgID
	c.next = (c.next + 1) % c.size
}

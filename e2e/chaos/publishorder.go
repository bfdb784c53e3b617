package chaos

import (
	"cmp"
	"fmt"
	"slices"
)

// Sighting is one message id as the publish-order tap saw it: a queue of the
// harness's own, bound to the orders exchange with the routing key of
// shipping's queue, that receives a copy of every message a relay routes,
// in the order the broker routed them. The harness numbers the deliveries
// it reads from the tap 1, 2, ...
type Sighting struct {
	MessageID string `json:"message_id"`
	// First and Last are the numbers of its first and last copies; Copies
	// how many the tap received (a relay's publish again, or a delivery
	// again after the harness's connection was lost before its ack).
	First  int64 `json:"first"`
	Last   int64 `json:"last"`
	Copies int   `json:"copies"`
	// FirstRedelivered says the first copy came with the redelivered flag:
	// the queue had handed it out before, to a consumer of the tap whose
	// delivery the harness never read, so it was routed before it was seen.
	FirstRedelivered bool `json:"first_redelivered,omitempty"`
}

// PublishOrder is what the publish-order tap saw over the run.
type PublishOrder struct {
	Sightings []Sighting
	// Reconnects counts the tap consumer's new connections after the first
	// (a broker fault cut it).
	Reconnects int
}

// publishOrder checks I3 on the order of publication (docs/guarantees.md):
// for each aggregate, for consecutive versions v and v+1 both sighted, the
// first copy of v+1 may not precede the first copy of v.
//
// Only first copies count: a copy sent again (a lost confirm, a relay
// paused past its lease, the tap's delivery again after its connection was
// lost) may come after anything. An event the tap never saw is not
// compared. One inversion is the relays' own: an event whose publish failed
// (no confirm: the broker, or the tap's queue, did not take it) has the
// events of its run behind it in the same batch go out again after it, and
// those may have reached the tap already. Such an inversion, where v+1 was
// seen again after v's first copy, is counted apart
// (PublishedOutOfOrderResent), not a violation.
//
// Another is the tap's queue's: v's first copy came redelivered
// (FirstRedelivered), so the queue had handed it out before, and it was
// routed earlier than seen. A quorum queue keeps the consumer of the tap's
// lost connection until it learns that the consumer is gone (after a
// failover of its own leader, or at once again when the consumer's node
// comes back, until its monitor fires): that consumer takes a copy while
// the live one takes the next, and the first copy comes back after it.
// The order of v and v+1 cannot be judged then: counted apart
// (PublishedOutOfOrderRedelivered), not a violation.
func (c *checker) publishOrder(s FinalState) {
	p := s.PublishOrder
	if p == nil {
		return
	}
	c.r.PublishOrderChecked = true
	c.r.PublishOrderTapReconnects = p.Reconnects
	seen := make(map[string]Sighting, len(p.Sightings))
	for _, x := range p.Sightings {
		seen[x.MessageID] = x
	}
	events := slices.Clone(s.Events)
	slices.SortFunc(events, func(a, b CommittedEvent) int {
		return cmp.Or(cmp.Compare(a.OrderID, b.OrderID), cmp.Compare(a.Version, b.Version))
	})
	for i, e := range events {
		cur, ok := seen[e.MessageID]
		if !ok {
			c.r.PublishOrderUnsighted++
			continue
		}
		c.r.PublishOrderSighted++
		if i == 0 {
			continue
		}
		prev := events[i-1]
		before, ok := seen[prev.MessageID]
		if !ok || prev.OrderID != e.OrderID || prev.Version != e.Version-1 || cur.First > before.First {
			continue
		}
		if cur.Last > before.First {
			c.r.PublishedOutOfOrderResent++
			continue
		}
		if before.FirstRedelivered {
			c.r.PublishedOutOfOrderRedelivered++
			continue
		}
		c.r.PublishedOutOfOrder++
		c.violate(Violation{Invariant: "I3", Kind: "published_out_of_order", OrderID: e.OrderID, MessageID: e.MessageID,
			Detail: fmt.Sprintf("v%d %s was first published (tap delivery %d) before v%d %s (tap delivery %d), and not again after it",
				e.Version, e.Type, cur.First, prev.Version, prev.Type, before.First)})
	}
	if c.r.PublishOrderSighted == 0 && len(events) > 0 {
		c.violate(Violation{Invariant: "I3", Kind: "publish_order_blind",
			Detail: fmt.Sprintf("the publish-order tap saw none of the %d committed events (%d message ids in all)", len(events), len(p.Sightings))})
	}
}

// publishOrderSummary is the summary line's part on the publish order.
func (r Report) publishOrderSummary() string {
	if !r.PublishOrderChecked {
		return " publish_order=none"
	}
	return fmt.Sprintf(" published_out_of_order=%d published_out_of_order_resent=%d published_out_of_order_redelivered=%d publish_order_sighted=%d publish_order_unsighted=%d",
		r.PublishedOutOfOrder, r.PublishedOutOfOrderResent, r.PublishedOutOfOrderRedelivered, r.PublishOrderSighted, r.PublishOrderUnsighted)
}

package chaos

import (
	"fmt"
	"maps"
	"slices"
	"time"
)

// FailoverAccount is what one postgres_failover lost, from its dead
// primary read back (DeadPrimaryState) against its successor: the next dead
// primary, or the final state for the last one.
type FailoverAccount struct {
	StreamCut time.Time `json:"stream_cut"`
	Killed    time.Time `json:"killed"`
	// EventsHeld counts the dead primary's outbox rows; EventsBeyondSuccessor
	// those its successor lacks: what the failover lost.
	EventsHeld            int `json:"events_held"`
	EventsBeyondSuccessor int `json:"events_beyond_successor"`
	// FirstBeyondCutSeconds and LastBeyondCutSeconds place the created_at of
	// the first and last of those against the stream cut (negative: before
	// it, which StreamCutAllowance bounds).
	FirstBeyondCutSeconds float64 `json:"first_beyond_cut_seconds,omitempty"`
	LastBeyondCutSeconds  float64 `json:"last_beyond_cut_seconds,omitempty"`
}

// deadPrimary is a DeadPrimaryState indexed for the checker.
type deadPrimary struct {
	DeadPrimaryState
	orders map[string]CommittedOrder
	events map[string]CommittedEvent
}

// failovers holds the run's dead primaries, in the order they died.
type failovers []deadPrimary

func newFailovers(s FinalState) failovers {
	states := slices.Clone(s.DeadPrimaries)
	slices.SortStableFunc(states, func(a, b DeadPrimaryState) int { return a.Killed.Compare(b.Killed) })
	out := make(failovers, len(states))
	for i, d := range states {
		out[i] = deadPrimary{DeadPrimaryState: d, orders: make(map[string]CommittedOrder, len(d.Orders)),
			events: make(map[string]CommittedEvent, len(d.Events))}
		for _, o := range d.Orders {
			out[i].orders[o.ID] = o
		}
		for _, e := range d.Events {
			out[i].events[e.MessageID] = e
		}
	}
	return out
}

// holdsCreate tells whether a dead primary holds order id created under key:
// an acknowledged create the final state lacks is then the failover's loss
// (the last primary that held it died before its successor had it).
func (f failovers) holdsCreate(id, key string) bool {
	return slices.ContainsFunc(f, func(d deadPrimary) bool { o, ok := d.orders[id]; return ok && o.Key == key })
}

// holdsCancel tells whether a dead primary holds order id cancelled.
func (f failovers) holdsCancel(id string) bool {
	return slices.ContainsFunc(f, func(d deadPrimary) bool { o, ok := d.orders[id]; return ok && o.Status == StatusCancelled })
}

// holdsAmendment tells whether a dead primary holds the amendment of order
// id with note.
func (f failovers) holdsAmendment(id, note string) bool {
	return slices.ContainsFunc(f, func(d deadPrimary) bool {
		for _, e := range d.events {
			if e.OrderID == id && e.Type == EventAmended && e.Note == note {
				return true
			}
		}
		return false
	})
}

// event returns the outbox row of a dead primary published as messageID.
func (f failovers) event(messageID string) (CommittedEvent, bool) {
	for _, d := range slices.Backward(f) {
		if e, ok := d.events[messageID]; ok {
			return e, true
		}
	}
	return CommittedEvent{}, false
}

// accountFailovers checks that what each dead primary held beyond its
// successor fits the stream cut: it was created after the cut, give or take
// StreamCutAllowance (the successor streamed everything before). It also
// requires a dead primary read back for each postgres_failover injected.
func (c *checker) accountFailovers(f failovers, s FinalState) {
	final := make(map[string]CommittedEvent, len(s.Events))
	for _, e := range s.Events {
		final[e.MessageID] = e
	}
	if n := c.r.FaultsInjected[FaultPostgresFailover]; len(f) != n {
		c.violate(Violation{Invariant: "coverage", Kind: "dead_primary_not_read",
			Detail: fmt.Sprintf("%d postgres_failover injected, %d dead primaries read back: the failovers' losses cannot be told from the system's", n, len(f))})
	}
	for i, d := range f {
		successor := final
		if i+1 < len(f) {
			successor = f[i+1].events
		}
		a := FailoverAccount{StreamCut: d.StreamCut, Killed: d.Killed, EventsHeld: len(d.events)}
		var beyond []CommittedEvent
		for _, id := range slices.Sorted(maps.Keys(d.events)) {
			if _, ok := successor[id]; !ok {
				beyond = append(beyond, d.events[id])
			}
		}
		a.EventsBeyondSuccessor = len(beyond)
		slices.SortStableFunc(beyond, func(x, y CommittedEvent) int { return x.CreatedAt.Compare(y.CreatedAt) })
		if len(beyond) > 0 {
			a.FirstBeyondCutSeconds = beyond[0].CreatedAt.Sub(d.StreamCut).Seconds()
			a.LastBeyondCutSeconds = beyond[len(beyond)-1].CreatedAt.Sub(d.StreamCut).Seconds()
		}
		for _, e := range beyond {
			if early := d.StreamCut.Sub(e.CreatedAt); early > StreamCutAllowance {
				c.violate(Violation{Invariant: "I1", Kind: "lost_before_stream_cut", OrderID: e.OrderID, MessageID: e.MessageID,
					Detail: fmt.Sprintf("v%d %s, created %.1fs before the stream cut at %s, is on the primary that died at %s and not on its successor: "+
						"the failover cannot have lost it", e.Version, e.Type, early.Seconds(),
						d.StreamCut.Format(time.TimeOnly), d.Killed.Format(time.TimeOnly))})
			}
		}
		c.r.Failovers = append(c.r.Failovers, a)
	}
}

package chaos

import (
	"fmt"
	"slices"
	"time"
)

// Keys of Fault.Measures for the node faults of the cluster profile.
const (
	// MeasureLeaderOnDownNode: node_kill_leader and node_partition read the
	// leader of shipping's queue while the target is down (or cut away):
	// 1 when it is still the target (the leadership did not move), 0 when
	// it is another node, -1 when it could not be read.
	MeasureLeaderOnDownNode = "leader_on_down_node"
	// MeasureQuorumLostFrom and MeasureQuorumLostTo bound, in seconds after
	// the fault's Start, the time node_majority_down held two nodes of three
	// down: from the kill to the start of their restart.
	MeasureQuorumLostFrom = "quorum_lost_from_seconds"
	MeasureQuorumLostTo   = "quorum_lost_to_seconds"
)

// NodeFaultDrainBound bounds, after each node fault, the time from its end
// until every outbox row created during it is published: a relay stalled
// for minutes after a node came back (220 s once) fails it.
const NodeFaultDrainBound = 90 * time.Second

// QuorumLossGrace is how long after the majority's kill a row may still be
// marked published: a confirm the broker sent before the kill is marked a
// moment later.
const QuorumLossGrace = 2 * time.Second

// NodeFaultDrain is how long the rows created during one node fault took
// to be published after it ended.
type NodeFaultDrain struct {
	Kind   FaultKind `json:"kind"`
	Target string    `json:"target,omitempty"`
	End    time.Time `json:"end"`
	// Rows were created during the fault; DrainSeconds is from its end to
	// the last one's publication (0 when all were published before the end).
	Rows         int     `json:"rows"`
	DrainSeconds float64 `json:"drain_seconds"`
}

// clusterFaults checks the node faults: the queue's leadership left a node
// killed as its leader or cut away by a partition; no outbox row was marked
// published while the majority was down (the relay got no confirm without
// a quorum); and the rows created during each node fault were published
// within NodeFaultDrainBound of its end.
func (c *checker) clusterFaults(h History, s FinalState) {
	for _, f := range h.Faults {
		if !slices.Contains(ClusterFaultKinds, f.Kind) {
			continue
		}
		if f.Kind == FaultNodeKillLeader || f.Kind == FaultNodePartition {
			switch v, ok := f.Measures[MeasureLeaderOnDownNode]; {
			case !ok || v < 0:
				c.violate(Violation{Invariant: "cluster", Kind: "leader_unknown",
					Detail: fmt.Sprintf("%s on %s at %s: the leader of shipping's queue could not be read while the node was away", f.Kind, f.Target, f.Start.Format(time.TimeOnly))})
			case v == 1:
				c.violate(Violation{Invariant: "cluster", Kind: "leader_not_moved",
					Detail: fmt.Sprintf("%s on %s at %s: the node was still the leader of shipping's queue while away (%s)", f.Kind, f.Target, f.Start.Format(time.TimeOnly), f.Detail)})
			}
		}
		if f.Kind == FaultNodeMajorityDown {
			c.publishedWithoutQuorum(f, s)
		}
		d := NodeFaultDrain{Kind: f.Kind, Target: f.Target, End: f.End}
		var last time.Time
		for _, e := range s.Events {
			if e.CreatedAt.Before(f.Start) || e.CreatedAt.After(f.End) || e.DeadLettered {
				continue
			}
			d.Rows++
			if e.PublishedAt.After(last) {
				last = e.PublishedAt
			}
		}
		if last.After(f.End) {
			d.DrainSeconds = last.Sub(f.End).Seconds()
		}
		c.r.NodeFaultDrains = append(c.r.NodeFaultDrains, d)
		if d.DrainSeconds > NodeFaultDrainBound.Seconds() {
			c.violate(Violation{Invariant: "cluster", Kind: "node_fault_drain_too_slow",
				Detail: fmt.Sprintf("%s on %s: the %d rows created during it were published %.1fs after its end, bound %v", f.Kind, f.Target, d.Rows, d.DrainSeconds, NodeFaultDrainBound)})
		}
	}
}

// publishedWithoutQuorum: no row marked published between the majority's
// kill (plus QuorumLossGrace) and the start of its restart.
func (c *checker) publishedWithoutQuorum(f Fault, s FinalState) {
	from, okFrom := f.Measures[MeasureQuorumLostFrom]
	to, okTo := f.Measures[MeasureQuorumLostTo]
	if !okFrom || !okTo {
		c.violate(Violation{Invariant: "cluster", Kind: "quorum_loss_unmeasured",
			Detail: fmt.Sprintf("%s at %s recorded no quorum-loss window", f.Kind, f.Start.Format(time.TimeOnly))})
		return
	}
	start := f.Start.Add(time.Duration(from*float64(time.Second)) + QuorumLossGrace)
	end := f.Start.Add(time.Duration(to * float64(time.Second)))
	for _, e := range s.Events {
		if !e.PublishedAt.IsZero() && e.PublishedAt.After(start) && e.PublishedAt.Before(end) {
			c.violate(Violation{Invariant: "cluster", Kind: "published_without_quorum", OrderID: e.OrderID, MessageID: e.MessageID,
				Detail: fmt.Sprintf("v%d %s marked published at %s, while two nodes of three were down (%s to %s)", e.Version, e.Type,
					e.PublishedAt.Format("15:04:05.000"), start.Format("15:04:05.000"), end.Format("15:04:05.000"))})
		}
	}
}

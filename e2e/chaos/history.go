package chaos

import (
	"maps"
	"slices"
	"sync"
	"time"
)

// OpKind is what a client asked the orders API to do.
type OpKind string

// The operations the workload performs.
const (
	OpCreate OpKind = "create"
	OpCancel OpKind = "cancel"
	// OpAmend is POST /orders/{id}/amendments: the order's next version, an
	// order.amended event carrying the op's Note.
	OpAmend OpKind = "amend"
)

// Outcome is what the client learnt about an operation.
type Outcome string

// Outcomes of an operation, as seen by the client that performed it.
const (
	// OutcomeOK: the API acknowledged the operation (201 for a create or an
	// amendment, 200 for a cancel). The checker requires its effect to be
	// committed.
	OutcomeOK Outcome = "ok"
	// OutcomeFailed: the API refused the operation for good (a 4xx that a retry
	// cannot change). The checker requires that nothing was committed.
	OutcomeFailed Outcome = "failed"
	// OutcomeUnknown: every attempt ended in a transport error, a timeout or a
	// 5xx. The operation may or may not have been committed; both are correct.
	OutcomeUnknown Outcome = "unknown"
)

// Op is one client operation, after all its retries.
type Op struct {
	Kind OpKind `json:"kind"`
	// Key is the Idempotency-Key of a create or an amendment. The workload
	// also sends a create's as the order's customer_id, so a committed order
	// names the operation that made it even when the client never learnt the
	// order's id.
	Key string `json:"key,omitempty"`
	// OrderID is the order's id: the one a create was answered with (empty
	// when its outcome is not ok), or the one a cancel or an amendment was
	// sent for.
	OrderID string `json:"order_id,omitempty"`
	// Note is an amendment's note, unique in the run (the workload puts the
	// amendment's key in it), so that its order.amended event names it.
	Note string `json:"note,omitempty"`
	// Version is the order version an acknowledged amendment was answered
	// with (0 otherwise).
	Version  int64     `json:"version,omitempty"`
	Outcome  Outcome   `json:"outcome"`
	Attempts int       `json:"attempts"`
	Status   int       `json:"status,omitempty"` // last HTTP status, 0 when none came back
	Err      string    `json:"error,omitempty"`  // last error, for the report
	Start    time.Time `json:"start"`
	End      time.Time `json:"end"`
}

// Fault is one fault the suite injected.
type Fault struct {
	Kind   FaultKind `json:"kind"`
	Target string    `json:"target,omitempty"` // e.g. "relay-1", "amqp-shipping"
	Start  time.Time `json:"start"`
	End    time.Time `json:"end"` // when it was healed; equal to Start for an instant fault
	Detail string    `json:"detail,omitempty"`
	// Measures are numbers an infrastructure fault took (see the Measure
	// constants), for the report.
	Measures map[string]float64 `json:"measures,omitempty"`
	// StreamCut is, for a postgres_failover, when the standby promoted in
	// the primary's place was cut from its stream (Start is the kill).
	StreamCut time.Time `json:"stream_cut,omitzero"`
}

// PoisonKind is a kind of bad message published straight to the exchange.
type PoisonKind string

// The poison messages the suite injects.
const (
	PoisonMalformed        PoisonKind = "malformed_payload"
	PoisonMissingMessageID PoisonKind = "missing_message_id"
	PoisonUnknownType      PoisonKind = "unknown_event_type"
	PoisonOversize         PoisonKind = "oversize"
)

// PoisonKinds lists every poison kind.
var PoisonKinds = []PoisonKind{PoisonMalformed, PoisonMissingMessageID, PoisonUnknownType, PoisonOversize}

// ExpectDeadLetter tells whether the consumer must dead-letter a message of
// kind k. An unknown event type is acknowledged and logged instead: a newer
// producer may emit types an older consumer does not handle.
func (k PoisonKind) ExpectDeadLetter() bool { return k != PoisonUnknownType }

// Poison is one bad message the suite published.
type Poison struct {
	// ID tags the message in a header (PoisonHeader), so it is recognised in
	// the dead-letter queue even when it has no MessageId.
	ID        string     `json:"id"`
	Kind      PoisonKind `json:"kind"`
	MessageID string     `json:"message_id,omitempty"`
	// OrderID is the order id in the payload: no real order's, so the checker
	// sees it if a consumer wrongly applied the message.
	OrderID string    `json:"order_id,omitempty"`
	At      time.Time `json:"at"`
}

// PoisonHeader is the AMQP header carrying Poison.ID. Dead-lettering keeps a
// message's headers, so the tag survives into the dead-letter queue.
const PoisonHeader = "x-chaos-poison-id"

// History is everything the suite did during a run.
type History struct {
	Ops    []Op     `json:"ops"`
	Faults []Fault  `json:"faults"`
	Poison []Poison `json:"poison"`
}

// Recorder collects a History from concurrent clients and fault injectors.
// The zero value is ready to use.
type Recorder struct {
	mu sync.Mutex
	h  History
}

// Op records a finished operation.
func (r *Recorder) Op(op Op) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Ops = append(r.h.Ops, op)
}

// Fault records an injected fault.
func (r *Recorder) Fault(f Fault) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Faults = append(r.h.Faults, f)
}

// Poison records a published poison message.
func (r *Recorder) Poison(p Poison) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Poison = append(r.h.Poison, p)
}

// AcknowledgedSince counts the operations the API acknowledged that started
// at or after t: each committed an event the relays, the broker and the
// consumers have to carry.
func (r *Recorder) AcknowledgedSince(t time.Time) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, op := range r.h.Ops {
		if op.Outcome == OutcomeOK && !op.Start.Before(t) {
			n++
		}
	}
	return n
}

// History returns a copy of what was recorded so far.
func (r *Recorder) History() History {
	r.mu.Lock()
	defer r.mu.Unlock()
	return History{
		Ops:    slices.Clone(r.h.Ops),
		Faults: slices.Clone(r.h.Faults),
		Poison: slices.Clone(r.h.Poison),
	}
}

// FaultCounts returns how many faults of each kind were recorded.
func (h History) FaultCounts() map[FaultKind]int {
	n := make(map[FaultKind]int)
	for _, f := range h.Faults {
		n[f.Kind]++
	}
	return n
}

// LastFaultEnd is when the last fault was healed (zero without faults).
func (h History) LastFaultEnd() time.Time {
	var last time.Time
	for _, f := range h.Faults {
		if f.End.After(last) {
			last = f.End
		}
	}
	return last
}

// MissingFaultKinds returns the kinds of want that were never injected, sorted.
func (h History) MissingFaultKinds(want []FaultKind) []FaultKind {
	got := h.FaultCounts()
	missing := make(map[FaultKind]bool)
	for _, k := range want {
		if got[k] == 0 {
			missing[k] = true
		}
	}
	return slices.Sorted(maps.Keys(missing))
}

package chaos

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Event types of the orders service (docs/events.md).
const (
	EventCreated   = "order.created"
	EventCancelled = "order.cancelled"
	EventAmended   = "order.amended"
)

// Order statuses (the orders API's `status`).
const (
	StatusCreated   = "created"
	StatusCancelled = "cancelled"
)

// CommittedOrder is an order row found in PostgreSQL after the run.
type CommittedOrder struct {
	ID string `json:"id"`
	// Key is the order's customer_id, which the workload sets to the create's
	// Idempotency-Key.
	Key     string `json:"key"`
	Status  string `json:"status"`
	Version int64  `json:"version"`
}

// CommittedEvent is an outbox row (pending, published or dead-lettered)
// found in PostgreSQL after the run.
type CommittedEvent struct {
	// MessageID is the message id the row is published under (its outbox id
	// and creation time, outbox.MessageID), the AMQP MessageId.
	MessageID string `json:"message_id"`
	OrderID   string `json:"order_id"`
	Version   int64  `json:"version"`
	Type      string `json:"type"`
	// Note is an order.amended event's note (its payload's), empty for the
	// other types.
	Note string `json:"note,omitempty"`
	// DeadLettered: the relay gave up on the row. The suite never asks for
	// that, so such an event counts as lost.
	DeadLettered bool `json:"dead_lettered,omitempty"`
	// CreatedAt is the row's created_at, the start of the transaction that
	// wrote it (the database's clock, the machine's).
	CreatedAt time.Time `json:"created_at,omitzero"`
	// PublishedAt is when the relay marked it published (outbox_published's
	// published_at), zero while it is not.
	PublishedAt time.Time `json:"published_at,omitzero"`
}

// AppliedEvent is one entry of a shipment's `events`, in applied order.
type AppliedEvent struct {
	MessageID string `json:"message_id"`
	EventType string `json:"event_type"`
	Version   int64  `json:"version"`
}

// Shipment is what the shipping service reports for an order.
type Shipment struct {
	OrderID string         `json:"order_id"`
	Status  string         `json:"status"`
	Events  []AppliedEvent `json:"events"`
}

// DeadLetter is a message found in the shipping consumer's dead-letter queue.
type DeadLetter struct {
	// PoisonID is the message's PoisonHeader, empty for a message the suite
	// did not inject.
	PoisonID   string `json:"poison_id,omitempty"`
	MessageID  string `json:"message_id,omitempty"`
	RoutingKey string `json:"routing_key,omitempty"`
	// Reason is why the consumer dead-lettered the message.
	Reason string `json:"reason"`
}

// FinalState is what the system holds after the run was healed and drained.
type FinalState struct {
	Orders      []CommittedOrder
	Events      []CommittedEvent
	Shipments   []Shipment
	DeadLetters []DeadLetter
	// DuplicatesDelivered counts messages the consumers received again after
	// their effect was recorded, and skipped (the inbox's duplicates).
	DuplicatesDelivered int64
	// DeadPrimaries are the primaries asynchronous failovers replaced
	// (postgres_failover), in the order they died, each as it was read back
	// after its death. The checker excuses an acknowledged operation the
	// database lacks only when a dead primary holds it.
	DeadPrimaries []DeadPrimaryState
	// Effects, when set, is audited (witness.go): the effect log shows a
	// message handled twice, the inbox holds a done record for every effect
	// and none without one.
	Effects *EffectsAudit
	// PublishOrder, when set, is what the publish-order tap saw
	// (publishorder.go): I3 on the order the relays published each
	// aggregate's events in, which shipping's version gate hides from the
	// effects.
	PublishOrder *PublishOrder
}

// DeadPrimaryState is what a primary held when a postgres_failover killed
// it: its data directory, kept past the promotion of its successor, started
// alone (crash recovery, no replication, no TCP listener) and read with the
// readers of the final state.
type DeadPrimaryState struct {
	// StreamCut is when its successor (the standby promoted in its place)
	// was cut from its stream; Killed, when it was stopped immediately. The
	// successor holds everything it committed before the cut, give or take
	// StreamCutAllowance.
	StreamCut time.Time
	Killed    time.Time
	Orders    []CommittedOrder
	Events    []CommittedEvent
}

// StreamCutAllowance is how much earlier than the stream cut an event the
// successor lacks may have been created: created_at is its transaction's
// start, and the standby may lag a little before the cut.
const StreamCutAllowance = 2 * time.Second

// RunInfo is what the checker needs to know about the run besides its
// history and final state.
type RunInfo struct {
	Seed     int64
	Profile  string
	Provider string
	// Drained: every committed event reached shipping before the deadline.
	Drained bool
	// DrainTime is the time from the end of the last fault to the drain.
	DrainTime   time.Duration
	DrainBudget time.Duration
	// RequireKinds are the fault kinds that must have been injected.
	RequireKinds []FaultKind
	// RequireDuplicates makes I4 require at least one absorbed duplicate.
	RequireDuplicates bool
	// Identity names the run in the report.
	Identity RunIdentity
	// InboxTransactions: shipping's inbox ran in transaction mode (a replica
	// set), where nothing explains a second entry of the effect log.
	InboxTransactions bool
	// InboxRecordWindow is how long after its effect a standalone inbox's
	// done record may still be unwritten without any fault (buffered
	// records: the flush interval and the flush itself).
	InboxRecordWindow time.Duration
}

// Violation is one broken invariant.
type Violation struct {
	Invariant string `json:"invariant"` // I1 ... I6, or "coverage"
	Kind      string `json:"kind"`
	OrderID   string `json:"order_id,omitempty"`
	MessageID string `json:"message_id,omitempty"`
	Detail    string `json:"detail"`
}

func (v Violation) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", v.Invariant, v.Kind)
	if v.OrderID != "" {
		fmt.Fprintf(&b, " order=%s", v.OrderID)
	}
	if v.MessageID != "" {
		fmt.Fprintf(&b, " message=%s", v.MessageID)
	}
	return b.String() + ": " + v.Detail
}

// MaxReportedViolations bounds Report.Violations; ViolationCount has them all.
const MaxReportedViolations = 200

// Report is the checker's verdict, written as JSON.
type Report struct {
	Seed     int64  `json:"seed"`
	Profile  string `json:"profile"`
	Provider string `json:"provider"`
	OK       bool   `json:"ok"`
	// Identity names the run: relay mode, environment overrides, the kinds
	// required and skipped, topology, commit.
	Identity RunIdentity `json:"identity"`

	OrdersAcknowledged  int `json:"orders_acknowledged"`
	OrdersFailed        int `json:"orders_failed"`
	OrdersUnknown       int `json:"orders_unknown"`
	CancelsAcknowledged int `json:"cancels_acknowledged"`
	CancelsFailed       int `json:"cancels_failed"`
	CancelsUnknown      int `json:"cancels_unknown"`
	OrdersCommitted     int `json:"orders_committed"`
	EventsCommitted     int `json:"events_committed"`
	EffectsApplied      int `json:"effects_applied"`

	// Amendments: POST /orders/{id}/amendments, each an order's next
	// version.
	AmendmentsAcknowledged int `json:"amendments_acknowledged"`
	AmendmentsFailed       int `json:"amendments_failed"`
	AmendmentsUnknown      int `json:"amendments_unknown"`
	// OrderVersions counts the committed orders by version: how long the
	// chains of events the run drove were.
	OrderVersions map[int64]int `json:"order_versions"`

	// I1
	AcknowledgedNotCommitted int `json:"acknowledged_not_committed"`
	FailedButCommitted       int `json:"failed_but_committed"`
	// LostByDatabaseFailover counts acknowledged creates, amendments and cancels the
	// database lacks that a primary killed by an asynchronous failover
	// (postgres_failover) held, read back after its death
	// (FinalState.DeadPrimaries): the loss asynchronous replication allows,
	// reported apart from I1 and I2. FailoverOrphanEffects counts effects of
	// no committed event that are of an outbox row of such a dead primary
	// (published from it before it died). Failovers has each failover's
	// account; what a dead primary holds beyond its successor must have
	// been created after the stream cut (I1 lost_before_stream_cut).
	LostByDatabaseFailover int `json:"lost_by_database_failover"`
	FailoverOrphanEffects  int `json:"failover_orphan_effects"`
	// VersionsTakenByFailoverOrphans counts committed events shipping
	// refused (dead letter version_conflict) because it had applied, at
	// their order's version, an orphan of a dead primary: the successor
	// reused a version the lost event had taken. The divergence an
	// asynchronous failover allows, for an operator to reconcile; reported
	// apart from I2 and I6. It also counts orphans shipping refused the same
	// way, when the successor's event at their version came first.
	VersionsTakenByFailoverOrphans int               `json:"versions_taken_by_failover_orphans"`
	Failovers                      []FailoverAccount `json:"failovers,omitempty"`
	// I2
	Lost             int `json:"lost"`
	DuplicateEffects int `json:"duplicate_effects"`
	UnknownEffects   int `json:"unknown_effects"`
	// EffectsAudited: the effect log and the inbox were read and audited
	// (FinalState.Effects).
	EffectsAudited bool `json:"effects_audited"`
	// Duplicates by the layer that caught them. DuplicatesAbsorbedInbox and
	// DuplicatesAbsorbedVersion are shipping's counter by label (the inbox's
	// record; the shipment already held the message). WitnessEntries counts
	// the effect log's entries; a message with more than one is a handler
	// run again: explained (standalone mode: the writer of the earlier entry
	// was killed before the inbox could record it, the copies ran within
	// the record's window, a MongoDB fault cut the record's write; see
	// WitnessExplanations) or not (a duplicate_effect, in DuplicateEffects).
	DuplicatesAbsorbedInbox      int64                `json:"duplicates_absorbed_inbox"`
	DuplicatesAbsorbedVersion    int64                `json:"duplicates_absorbed_version"`
	WitnessEntries               int                  `json:"witness_entries"`
	WitnessDuplicatesExplained   int                  `json:"witness_duplicates_explained"`
	WitnessDuplicatesUnexplained int                  `json:"witness_duplicates_unexplained"`
	WitnessExplanations          []WitnessExplanation `json:"witness_explanations,omitempty"`
	// The inbox audit: InboxRecords done records read; InboxRecordsLost
	// effects without a done record whose writer was killed before its
	// buffered record was written (standalone mode); InboxAuditViolations
	// effects without a record, records without an effect, claims left.
	InboxRecords         int `json:"inbox_records"`
	InboxRecordsLost     int `json:"inbox_records_lost"`
	InboxAuditViolations int `json:"inbox_audit_violations"`
	// I3
	OutOfOrder int `json:"out_of_order"`
	// I3 on publication (publishorder.go): PublishOrderChecked says the
	// run had the tap; PublishOrderSighted and PublishOrderUnsighted count
	// the committed events the tap saw and missed; PublishedOutOfOrder the
	// aggregates' consecutive events whose first copies the tap saw
	// inverted (violations); PublishedOutOfOrderResent the inversions
	// excused because the later event was published again after the
	// earlier one's first copy (a run behind an event whose publish
	// failed); PublishedOutOfOrderRedelivered those where the earlier
	// event's first copy came redelivered by the tap's queue (its place in
	// routing order unknown); PublishOrderTapReconnects how often the tap's
	// consumer lost its connection.
	PublishOrderChecked            bool `json:"publish_order_checked"`
	PublishOrderSighted            int  `json:"publish_order_sighted"`
	PublishOrderUnsighted          int  `json:"publish_order_unsighted"`
	PublishedOutOfOrder            int  `json:"published_out_of_order"`
	PublishedOutOfOrderResent      int  `json:"published_out_of_order_resent"`
	PublishedOutOfOrderRedelivered int  `json:"published_out_of_order_redelivered"`
	PublishOrderTapReconnects      int  `json:"publish_order_tap_reconnects"`
	// I4
	DuplicatesDelivered int64 `json:"duplicates_delivered"`
	// I5
	Drained            bool    `json:"drained"`
	DrainSeconds       float64 `json:"drain_seconds"`
	DrainBudgetSeconds float64 `json:"drain_budget_seconds"`
	// I6
	DeadLetters           int `json:"dead_letters"`
	DeadLettersExpected   int `json:"dead_letters_expected"`
	UnexpectedDeadLetters int `json:"unexpected_dead_letters"`
	MissingDeadLetters    int `json:"missing_dead_letters"`
	// DeadLetterCopies counts extra copies of an expected dead letter:
	// dead-lettering is at-least-once, so a consumer killed between the
	// dead-letter publish and its ack may dead-letter a poison message twice.
	DeadLetterCopies int `json:"dead_letter_copies"`

	FaultsInjected    map[FaultKind]int `json:"faults_injected"`
	FaultsTotal       int               `json:"faults_total"`
	MissingFaultKinds []FaultKind       `json:"missing_fault_kinds,omitempty"`
	// Faults lists every fault injected with its actual times, by start.
	Faults []Fault `json:"faults"`

	// NodeFaultDrains: how long the rows created during each node fault
	// took to be published after it (NodeFaultDrainBound).
	NodeFaultDrains []NodeFaultDrain `json:"node_fault_drains,omitempty"`

	// FaultMeasures: what each infrastructure fault, pause and PostgreSQL path
	// fault measured.
	FaultMeasures []FaultMeasure `json:"fault_measures,omitempty"`

	ViolationCount int         `json:"violation_count"`
	Violations     []Violation `json:"violations"`
}

// Check verifies invariants I1-I6 (docs/guarantees.md) over a run's history and
// final state. It is pure: same input, same report.
func Check(h History, s FinalState, run RunInfo) Report {
	c := checker{h: h, failovers: newFailovers(s), r: Report{
		Seed: run.Seed, Profile: run.Profile, Provider: run.Provider,
		OrdersCommitted: len(s.Orders), EventsCommitted: len(s.Events),
		DuplicatesDelivered: s.DuplicatesDelivered,
		Drained:             run.Drained,
		DrainSeconds:        run.DrainTime.Seconds(),
		DrainBudgetSeconds:  run.DrainBudget.Seconds(),
		FaultsInjected:      h.FaultCounts(),
		FaultsTotal:         len(h.Faults),
		Faults:              sortedFaults(h.Faults),
		Identity:            run.Identity,
		Violations:          []Violation{},
	}}
	c.ordersAcknowledged(h, s) // I1
	c.eventsApplied(h, s)      // I2, I3
	c.publishOrder(s)          // I3: the order of publication
	c.audit(h, s, run)         // I2: the effect log and the inbox
	c.duplicates(run)          // I4
	c.drain(run)               // I5
	c.deadLetters(h, s)        // I6
	c.accountFailovers(c.failovers, s)
	c.clusterFaults(h, s)
	c.coverage(h, run)
	c.r.FaultMeasures = faultMeasures(h)
	c.infraFaults(h)
	c.r.OK = c.r.ViolationCount == 0
	return c.r
}

// sortedFaults is faults by start time (the recorder has them by end).
func sortedFaults(faults []Fault) []Fault {
	out := slices.Clone(faults)
	if out == nil {
		out = []Fault{}
	}
	slices.SortStableFunc(out, func(a, b Fault) int { return a.Start.Compare(b.Start) })
	return out
}

type checker struct {
	r         Report
	h         History
	failovers failovers
	// takenByOrphan holds the committed events whose version an applied
	// failover orphan took (eventsApplied), for deadLetters.
	takenByOrphan map[string]bool
	// failures holds the effects audit's failed runs by message id.
	failures map[string][]RunFailure
}

// refusedOrphan says msg is a failover orphan: the event of an outbox row of
// a dead primary that no committed event carries.
func (c *checker) refusedOrphan(s FinalState, msg string) bool {
	if slices.ContainsFunc(s.Events, func(e CommittedEvent) bool { return e.MessageID == msg }) {
		return false
	}
	_, ok := c.failovers.event(msg)
	return ok
}

func (c *checker) violate(v Violation) {
	c.r.ViolationCount++
	if len(c.r.Violations) < MaxReportedViolations {
		c.r.Violations = append(c.r.Violations, v)
	}
}

// I1: every acknowledged order (and cancel, and amendment) is committed;
// nothing reported failed was committed. Also: each committed order carries
// exactly the events its state implies, written in the same transaction:
// v1 order.created, then its amendments (order.amended), then at most one
// order.cancelled as the last version, versions without gaps up to the
// order's.
func (c *checker) ordersAcknowledged(h History, s FinalState) {
	byID := make(map[string]CommittedOrder, len(s.Orders))
	byKey := make(map[string][]CommittedOrder, len(s.Orders))
	c.r.OrderVersions = make(map[int64]int)
	for _, o := range s.Orders {
		byID[o.ID] = o
		byKey[o.Key] = append(byKey[o.Key], o)
		c.r.OrderVersions[o.Version]++
	}
	for _, key := range slices.Sorted(maps.Keys(byKey)) {
		if os := byKey[key]; key != "" && len(os) > 1 {
			c.violate(Violation{Invariant: "I1", Kind: "idempotency_broken", OrderID: os[0].ID,
				Detail: fmt.Sprintf("%d orders committed for Idempotency-Key %q", len(os), key)})
		}
	}
	amended := amendmentsByNote(s.Events)
	atVersion := make(map[VersionKey]CommittedEvent, len(s.Events))
	for _, e := range s.Events {
		atVersion[VersionKey{e.OrderID, e.Version}] = e
	}
	for _, k := range slices.SortedFunc(maps.Keys(amended), func(a, b noteRef) int {
		return cmp.Or(cmp.Compare(a.orderID, b.orderID), cmp.Compare(a.note, b.note))
	}) {
		if es := amended[k]; len(es) > 1 {
			var vs []string
			for _, e := range es {
				vs = append(vs, fmt.Sprintf("v%d", e.Version))
			}
			c.violate(Violation{Invariant: "I1", Kind: "idempotency_broken", OrderID: k.orderID,
				Detail: fmt.Sprintf("amendment %q committed %d times (%s)", k.note, len(es), strings.Join(vs, ", "))})
		}
	}
	for _, op := range h.Ops {
		switch op.Kind {
		case OpCreate:
			c.checkCreate(op, byID, byKey)
		case OpCancel:
			c.checkCancel(op, byID)
		case OpAmend:
			c.checkAmend(op, amended, atVersion)
		}
	}

	events := make(map[string][]CommittedEvent)
	for _, e := range s.Events {
		events[e.OrderID] = append(events[e.OrderID], e)
	}
	for _, o := range s.Orders {
		got := slices.Clone(events[o.ID])
		slices.SortFunc(got, func(a, b CommittedEvent) int { return cmp.Compare(a.Version, b.Version) })
		var desc []string
		for _, e := range got {
			desc = append(desc, fmt.Sprintf("v%d %s", e.Version, e.Type))
		}
		if !chainMatches(o, got) {
			c.violate(Violation{Invariant: "I1", Kind: "order_events_mismatch", OrderID: o.ID,
				Detail: fmt.Sprintf("order is %s at version %d but its outbox holds [%s]; want v1 %s, then %s, then %s only if cancelled",
					o.Status, o.Version, strings.Join(desc, ", "), EventCreated, EventAmended, EventCancelled)})
		}
		delete(events, o.ID)
	}
	for _, id := range slices.Sorted(maps.Keys(events)) {
		c.violate(Violation{Invariant: "I1", Kind: "event_without_order", OrderID: id,
			Detail: fmt.Sprintf("%d outbox events for an order that was never committed", len(events[id]))})
	}
}

// chainMatches says whether an order's events, sorted by version, are those
// its row implies: versions 1 to o.Version, v1 order.created, the last
// order.cancelled when the order is cancelled, every other one
// order.amended.
func chainMatches(o CommittedOrder, events []CommittedEvent) bool {
	if int64(len(events)) != o.Version || len(events) == 0 {
		return false
	}
	last := len(events) - 1
	for i, e := range events {
		want := EventAmended
		switch {
		case i == 0:
			want = EventCreated
		case i == last && o.Status == StatusCancelled:
			want = EventCancelled
		}
		if e.Version != int64(i+1) || e.Type != want {
			return false
		}
	}
	return o.Status != StatusCancelled || last > 0
}

// VersionKey names one version of one order.
type VersionKey struct {
	OrderID string
	Version int64
}

// noteRef names an amendment by its order and note, which the workload
// makes unique (it holds the amendment's Idempotency-Key).
type noteRef struct{ orderID, note string }

// amendmentsByNote returns the committed order.amended events by order and
// note.
func amendmentsByNote(events []CommittedEvent) map[noteRef][]CommittedEvent {
	m := make(map[noteRef][]CommittedEvent)
	for _, e := range events {
		if e.Type == EventAmended {
			k := noteRef{e.OrderID, e.Note}
			m[k] = append(m[k], e)
		}
	}
	for _, es := range m {
		slices.SortFunc(es, func(a, b CommittedEvent) int { return cmp.Compare(a.Version, b.Version) })
	}
	return m
}

// checkAmend: an acknowledged amendment is committed as the version it was
// answered with, carrying its note; a refused one is not committed at all;
// an unknown one may be either (at most once: ordersAcknowledged counts the
// commits of each note).
func (c *checker) checkAmend(op Op, amended map[noteRef][]CommittedEvent, atVersion map[VersionKey]CommittedEvent) {
	es := amended[noteRef{op.OrderID, op.Note}]
	switch op.Outcome {
	case OutcomeOK:
		c.r.AmendmentsAcknowledged++
		other, taken := atVersion[VersionKey{op.OrderID, op.Version}]
		switch {
		case len(es) == 0 && c.failovers.holdsAmendment(op.OrderID, op.Note):
			c.r.LostByDatabaseFailover++
		case len(es) == 0 && taken && other.Type == EventAmended:
			c.r.AcknowledgedNotCommitted++
			c.violate(Violation{Invariant: "I1", Kind: "amendment_content_mismatch", OrderID: op.OrderID, MessageID: other.MessageID,
				Detail: fmt.Sprintf("amendment %q was answered %d as v%d with note %q, but v%d is committed as %s with note %q",
					op.Key, op.Status, op.Version, op.Note, other.Version, other.Type, other.Note)})
		case len(es) == 0:
			c.r.AcknowledgedNotCommitted++
			c.violate(Violation{Invariant: "I1", Kind: "acknowledged_amendment_not_committed", OrderID: op.OrderID,
				Detail: fmt.Sprintf("amendment %q was answered %d as v%d but no order.amended with its note is committed", op.Key, op.Status, op.Version)})
		case es[0].Version != op.Version:
			c.violate(Violation{Invariant: "I1", Kind: "amendment_content_mismatch", OrderID: op.OrderID, MessageID: es[0].MessageID,
				Detail: fmt.Sprintf("amendment %q was answered as v%d but its note is committed at v%d", op.Key, op.Version, es[0].Version)})
		}
	case OutcomeFailed:
		c.r.AmendmentsFailed++
		if len(es) > 0 {
			c.r.FailedButCommitted++
			c.violate(Violation{Invariant: "I1", Kind: "failed_but_committed", OrderID: op.OrderID, MessageID: es[0].MessageID,
				Detail: fmt.Sprintf("amendment %q was refused (HTTP %d: %s) but is committed as v%d", op.Key, op.Status, op.Err, es[0].Version)})
		}
	default:
		c.r.AmendmentsUnknown++
	}
}

func (c *checker) checkCreate(op Op, byID map[string]CommittedOrder, byKey map[string][]CommittedOrder) {
	switch op.Outcome {
	case OutcomeOK:
		c.r.OrdersAcknowledged++
		o, ok := byID[op.OrderID]
		switch {
		case !ok && c.failovers.holdsCreate(op.OrderID, op.Key):
			c.r.LostByDatabaseFailover++
		case !ok:
			c.r.AcknowledgedNotCommitted++
			c.violate(Violation{Invariant: "I1", Kind: "acknowledged_not_committed", OrderID: op.OrderID,
				Detail: fmt.Sprintf("create %q was answered %d but no such order is committed", op.Key, op.Status)})
		case o.Key != op.Key:
			c.violate(Violation{Invariant: "I1", Kind: "wrong_order_returned", OrderID: op.OrderID,
				Detail: fmt.Sprintf("create %q was answered with the order of %q", op.Key, o.Key)})
		}
	case OutcomeFailed:
		c.r.OrdersFailed++
		if os := byKey[op.Key]; len(os) > 0 {
			c.r.FailedButCommitted++
			c.violate(Violation{Invariant: "I1", Kind: "failed_but_committed", OrderID: os[0].ID,
				Detail: fmt.Sprintf("create %q was refused (HTTP %d: %s) but its order is committed", op.Key, op.Status, op.Err)})
		}
	default:
		c.r.OrdersUnknown++
	}
}

func (c *checker) checkCancel(op Op, byID map[string]CommittedOrder) {
	o, committed := byID[op.OrderID]
	cancelled := committed && o.Status == StatusCancelled
	switch op.Outcome {
	case OutcomeOK:
		c.r.CancelsAcknowledged++
		if !cancelled && c.failovers.holdsCancel(op.OrderID) {
			c.r.LostByDatabaseFailover++
		} else if !cancelled {
			c.r.AcknowledgedNotCommitted++
			c.violate(Violation{Invariant: "I1", Kind: "acknowledged_cancel_not_committed", OrderID: op.OrderID,
				Detail: fmt.Sprintf("cancel was answered %d but the order is %q", op.Status, o.Status)})
		}
	case OutcomeFailed:
		c.r.CancelsFailed++
		if cancelled {
			c.r.FailedButCommitted++
			c.violate(Violation{Invariant: "I1", Kind: "failed_but_committed", OrderID: op.OrderID,
				Detail: fmt.Sprintf("cancel was refused (HTTP %d: %s) but the order is cancelled", op.Status, op.Err)})
		}
	default:
		c.r.CancelsUnknown++
	}
}

// I2: each committed event has exactly one effect. I3: per order, effects in
// version order, from 1, without gaps.
func (c *checker) eventsApplied(h History, s FinalState) {
	type applied struct {
		orderID string
		event   AppliedEvent
	}
	times := make(map[string]int)
	var firsts []applied
	shipments := slices.Clone(s.Shipments)
	slices.SortFunc(shipments, func(a, b Shipment) int { return cmp.Compare(a.OrderID, b.OrderID) })
	for _, sh := range shipments {
		for _, e := range sh.Events {
			c.r.EffectsApplied++
			times[e.MessageID]++
			if times[e.MessageID] == 1 {
				firsts = append(firsts, applied{sh.OrderID, e})
			}
		}
	}

	committed := make(map[string]CommittedEvent, len(s.Events))
	events := slices.Clone(s.Events)
	slices.SortFunc(events, func(a, b CommittedEvent) int {
		return cmp.Or(cmp.Compare(a.OrderID, b.OrderID), cmp.Compare(a.Version, b.Version))
	})
	for _, e := range events {
		committed[e.MessageID] = e
	}
	// The orphans shipping applied, by order and version.
	orphanAt := make(map[string]string)
	for _, a := range firsts {
		if _, ok := committed[a.event.MessageID]; ok {
			continue
		}
		if _, ok := c.failovers.event(a.event.MessageID); ok {
			orphanAt[fmt.Sprintf("%s/%d", a.orderID, a.event.Version)] = a.event.MessageID
		}
	}
	for _, e := range events {
		n := times[e.MessageID]
		switch {
		case n == 0 && !e.DeadLettered && orphanAt[fmt.Sprintf("%s/%d", e.OrderID, e.Version)] != "":
			c.r.VersionsTakenByFailoverOrphans++
			if c.takenByOrphan == nil {
				c.takenByOrphan = make(map[string]bool)
			}
			c.takenByOrphan[e.MessageID] = true
		case e.DeadLettered:
			c.r.Lost++
			c.violate(Violation{Invariant: "I2", Kind: "lost", OrderID: e.OrderID, MessageID: e.MessageID,
				Detail: fmt.Sprintf("v%d %s was dead-lettered by the relay", e.Version, e.Type)})
		case n == 0:
			c.r.Lost++
			c.violate(Violation{Invariant: "I2", Kind: "lost", OrderID: e.OrderID, MessageID: e.MessageID,
				Detail: fmt.Sprintf("v%d %s was committed but never applied by shipping", e.Version, e.Type)})
		case n > 1:
			c.r.DuplicateEffects += n - 1
			c.violate(Violation{Invariant: "I2", Kind: "duplicate_effect", OrderID: e.OrderID, MessageID: e.MessageID,
				Detail: fmt.Sprintf("v%d %s was applied %d times", e.Version, e.Type, n)})
		}
	}
	for _, a := range firsts {
		e, ok := committed[a.event.MessageID]
		orphan := false
		if !ok {
			// An effect of no committed event is a failover's orphan only
			// when a dead primary held its outbox row (published from it
			// before it died): the row is then checked like a committed one.
			e, ok = c.failovers.event(a.event.MessageID)
			orphan = ok
		}
		switch {
		case !ok:
			c.r.UnknownEffects++
			c.violate(Violation{Invariant: "I2", Kind: "unknown_effect", OrderID: a.orderID, MessageID: a.event.MessageID,
				Detail: fmt.Sprintf("shipping applied %s v%d, which is no committed event", a.event.EventType, a.event.Version)})
		case e.OrderID != a.orderID || e.Type != a.event.EventType || e.Version != a.event.Version:
			c.r.UnknownEffects++
			c.violate(Violation{Invariant: "I2", Kind: "corrupted_effect", OrderID: a.orderID, MessageID: a.event.MessageID,
				Detail: fmt.Sprintf("applied as %s v%d on order %s, committed as %s v%d on order %s",
					a.event.EventType, a.event.Version, a.orderID, e.Type, e.Version, e.OrderID)})
		case orphan:
			c.r.FailoverOrphanEffects++
		}
	}

	// I3, on each shipment's first application of each message.
	for _, sh := range shipments {
		seen := make(map[string]bool)
		var versions []string
		inOrder := true
		next := int64(1)
		for _, e := range sh.Events {
			if seen[e.MessageID] {
				continue // a duplicate, counted by I2
			}
			seen[e.MessageID] = true
			versions = append(versions, fmt.Sprintf("v%d %s", e.Version, e.EventType))
			inOrder = inOrder && e.Version == next && (e.Version != 1 || e.EventType == EventCreated)
			next++
		}
		if !inOrder {
			c.r.OutOfOrder++
			c.violate(Violation{Invariant: "I3", Kind: "out_of_order", OrderID: sh.OrderID,
				Detail: "applied " + strings.Join(versions, ", ") + "; want versions 1, 2, ... starting with " + EventCreated})
		}
	}
}

// I4: the run made the inbox work.
func (c *checker) duplicates(run RunInfo) {
	if run.RequireDuplicates && c.r.DuplicatesDelivered == 0 {
		c.violate(Violation{Invariant: "I4", Kind: "no_duplicates",
			Detail: "no duplicate delivery was absorbed: the run did not exercise the inbox"})
	}
}

// I5: the system drained within the budget after the last fault.
func (c *checker) drain(run RunInfo) {
	switch {
	case !run.Drained:
		c.violate(Violation{Invariant: "I5", Kind: "not_drained",
			Detail: fmt.Sprintf("committed events still without effect %.1fs after the last fault", run.DrainTime.Seconds())})
	case run.DrainTime > run.DrainBudget:
		c.violate(Violation{Invariant: "I5", Kind: "drain_too_slow",
			Detail: fmt.Sprintf("drained in %.1fs, budget %.1fs", run.DrainTime.Seconds(), run.DrainBudget.Seconds())})
	}
}

// I6: the dead letters are exactly the injected poison messages, each with a
// reason; an unknown event type is not among them.
func (c *checker) deadLetters(h History, s FinalState) {
	c.r.DeadLetters = len(s.DeadLetters)
	poison := make(map[string]Poison, len(h.Poison))
	for _, p := range h.Poison {
		poison[p.ID] = p
		if p.Kind.ExpectDeadLetter() {
			c.r.DeadLettersExpected++
		}
	}
	found := make(map[string]int)
	for _, d := range s.DeadLetters {
		p, injected := poison[d.PoisonID]
		switch {
		case !injected && d.Reason == "version_conflict" && c.takenByOrphan[d.MessageID]:
			continue // counted in VersionsTakenByFailoverOrphans
		case !injected && d.Reason == "version_conflict" && c.refusedOrphan(s, d.MessageID):
			// A dead primary's event, published before it died, reached
			// shipping after the successor's event at its version.
			c.r.VersionsTakenByFailoverOrphans++
			continue
		case !injected:
			c.r.UnexpectedDeadLetters++
			c.violate(Violation{Invariant: "I6", Kind: "unexpected_dead_letter", MessageID: d.MessageID,
				Detail: fmt.Sprintf("%q was dead-lettered (reason %q) but is no injected poison", d.RoutingKey, d.Reason)})
			continue
		case !p.Kind.ExpectDeadLetter():
			c.r.UnexpectedDeadLetters++
			c.violate(Violation{Invariant: "I6", Kind: "unexpected_dead_letter", MessageID: d.MessageID,
				Detail: fmt.Sprintf("poison %s (%s) must be acknowledged and logged, not dead-lettered (reason %q)", p.ID, p.Kind, d.Reason)})
			continue
		case strings.TrimSpace(d.Reason) == "":
			c.violate(Violation{Invariant: "I6", Kind: "dead_letter_without_reason", MessageID: d.MessageID,
				Detail: fmt.Sprintf("poison %s (%s) was dead-lettered without a reason", p.ID, p.Kind)})
		}
		if found[p.ID]++; found[p.ID] > 1 {
			c.r.DeadLetterCopies++
		}
	}
	for _, p := range h.Poison {
		if p.Kind.ExpectDeadLetter() && found[p.ID] == 0 {
			c.r.MissingDeadLetters++
			c.violate(Violation{Invariant: "I6", Kind: "missing_dead_letter", MessageID: p.MessageID,
				Detail: fmt.Sprintf("poison %s (%s) is not in the dead-letter queue", p.ID, p.Kind)})
		}
	}
}

// coverage: the run injected what it was asked to.
func (c *checker) coverage(h History, run RunInfo) {
	c.r.MissingFaultKinds = h.MissingFaultKinds(run.RequireKinds)
	for _, k := range c.r.MissingFaultKinds {
		c.violate(Violation{Invariant: "coverage", Kind: "fault_not_injected", Detail: string(k) + " was never injected"})
	}
}

// Summary is the report in one line.
func (r Report) Summary() string {
	verdict := "PASS"
	if !r.OK {
		verdict = "FAIL(" + strconv.Itoa(r.ViolationCount) + " violations)"
	}
	return fmt.Sprintf("chaos %s: seed=%d profile=%s provider=%q acknowledged=%d committed=%d events=%d effects=%d "+
		"lost=%d duplicate_effects=%d out_of_order=%d duplicates_delivered=%d dead_letters=%d/%d faults=%d drain=%.1fs/%.0fs",
		verdict, r.Seed, r.Profile, r.Provider, r.OrdersAcknowledged, r.OrdersCommitted, r.EventsCommitted, r.EffectsApplied,
		r.Lost, r.DuplicateEffects, r.OutOfOrder, r.DuplicatesDelivered, r.DeadLetters, r.DeadLettersExpected,
		r.FaultsTotal, r.DrainSeconds, r.DrainBudgetSeconds) + r.publishOrderSummary() + r.auditSummary()
}

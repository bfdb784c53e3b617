package chaos

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"time"
)

// WitnessEntry is one entry of shipping's effect log (shipment_effect_log,
// services/shipping/internal/mongodb): shipping appends one each time its
// handler performs a message's effect, applied or found already applied by
// that same message, in the same inbox unit as the shipment. Unlike the
// shipment, which keeps one document per order version, it is not
// idempotent: a message handled twice shows twice.
type WitnessEntry struct {
	MessageID string `json:"message_id"`
	OrderID   string `json:"order_id"`
	Version   int64  `json:"version"`
	EventType string `json:"event_type"`
	// Started is when the handler run began (after the inbox's check), At
	// when the entry was written.
	Started time.Time `json:"started"`
	At      time.Time `json:"at"`
	// Writer is the process run that wrote it (Writer.ID).
	Writer string `json:"writer"`
}

// Writer is one shipping process run, as the suite started it, with the
// identity it writes effect-log entries under.
type Writer struct {
	// ID is the identity the process logged at start ("instance/pid").
	ID          string `json:"id"`
	Proc        string `json:"proc"`
	Incarnation int    `json:"incarnation"`
	// Exited is when the run ended, zero while it runs; Killed says it was
	// SIGKILLed (a kill, a crash point), not stopped gracefully (a graceful
	// stop writes the inbox's buffered records).
	Exited time.Time `json:"exited,omitzero"`
	Killed bool      `json:"killed,omitempty"`
}

// InboxRecord is a document of shipping's inbox collection (pkg/inbox).
type InboxRecord struct {
	MessageID string `json:"message_id"`
	// State is "done", or "processing" for a claim (inbox leases, which
	// shipping does not use).
	State       string    `json:"state"`
	ProcessedAt time.Time `json:"processed_at,omitzero"`
}

// StoredEffect is one document of shipping's shipment collection, no-ops
// (an event type shipping ignores, recorded at its version) included.
type StoredEffect struct {
	MessageID string `json:"message_id"`
	OrderID   string `json:"order_id"`
	Version   int64  `json:"version"`
	EventType string `json:"event_type"`
	// Discarded: an operator skipped the version; it has no inbox record.
	Discarded bool `json:"discarded,omitempty"`
}

// EffectsAudit is what the checker reads besides the shipments to audit
// each effect: the effect log (the witness), the processes that wrote it,
// the inbox's records, every stored effect document, and the duplicates the
// consumers absorbed by layer.
type EffectsAudit struct {
	Witness []WitnessEntry
	Writers []Writer
	Inbox   []InboxRecord
	Effects []StoredEffect
	// DuplicatesByLayer is shipping_events_duplicate_total by its layer
	// label: "inbox" (the inbox's record), "version" (the shipment already
	// held the message: the store absorbed what the inbox let through).
	DuplicatesByLayer map[string]int64
	// Failures are the runs that shipping logged as failed after the
	// inbox's check (the inbox or MongoDB failed, the handler failed): the
	// inbox recorded nothing and the message comes back.
	Failures []RunFailure
}

// RunFailure is one failed run of a message, as shipping logged it.
type RunFailure struct {
	MessageID string    `json:"message_id"`
	Writer    string    `json:"writer"` // Writer.ID of the process run
	At        time.Time `json:"at"`
	Msg       string    `json:"msg"`
}

// WitnessExplanation says why a second entry of the effect log is not a
// duplicate effect (standalone mode only).
type WitnessExplanation struct {
	MessageID string `json:"message_id"`
	// Reason: writer_killed, record_window, run_failed, mongo_fault or
	// session_lost.
	Reason string `json:"reason"`
	// Fault names the fault that explains it ("kind on target"), if any.
	Fault  string `json:"fault,omitempty"`
	Detail string `json:"detail"`
}

// shippingDeathKinds are the faults that SIGKILL a shipping process.
var shippingDeathKinds = []FaultKind{FaultKillShipping, FaultCrashShippingAfterEffect, FaultCrashShippingAfterInbox}

// mongoFaultKinds are the faults that can hold back or cut a standalone
// inbox's record write (or the reply to a write) without killing the
// process.
// mongoRecovery bounds how long after a MongoDB fault ends shipping's driver
// finds the server again (its heartbeat, 10 s by default) and a message
// whose run the fault failed comes back.
const mongoRecovery = 10 * time.Second

// failedRunEnd bounds how long after its effect a failing run logs its
// failure: each of its MongoDB writes waits up to shipping's server
// selection timeout (5 s), then a ping (2 s), on a loaded machine.
const failedRunEnd = 30 * time.Second

var mongoFaultKinds = []FaultKind{FaultMongoRestart, FaultMongoProxyDown, FaultMongoAckLoss, FaultMongoDiskFull}

// audit checks the effect log and the inbox against the stored effects (I2):
//
//   - a message with more than one effect-log entry was handled again: a
//     duplicate_effect unless, in standalone mode, what the history shows
//     explains each later entry (explainAgain); in transaction mode nothing
//     does, the entry commits with the inbox record;
//   - every stored effect has an entry, and every entry its effect;
//   - every stored effect (but an operator's discard) has a done record,
//     unless (standalone) its record was buffered when its writer was
//     killed (lostRecord); every done record has its effect; no claim is
//     left.
func (c *checker) audit(h History, s FinalState, run RunInfo) {
	a := s.Effects
	if a == nil {
		return
	}
	c.r.EffectsAudited = true
	c.r.DuplicatesAbsorbedInbox = a.DuplicatesByLayer["inbox"]
	c.r.DuplicatesAbsorbedVersion = a.DuplicatesByLayer["version"]
	c.r.WitnessEntries = len(a.Witness)
	writers := make(map[string]Writer, len(a.Writers))
	for _, w := range a.Writers {
		writers[w.ID] = w
	}
	c.failures = make(map[string][]RunFailure)
	for _, f := range a.Failures {
		c.failures[f.MessageID] = append(c.failures[f.MessageID], f)
	}
	entries := make(map[string][]WitnessEntry)
	for _, e := range a.Witness {
		entries[e.MessageID] = append(entries[e.MessageID], e)
	}
	effects := make(map[string]StoredEffect, len(a.Effects))
	for _, e := range a.Effects {
		effects[e.MessageID] = e
	}
	records := make(map[string]InboxRecord, len(a.Inbox))
	for _, r := range a.Inbox {
		records[r.MessageID] = r
	}

	for _, msg := range slices.Sorted(maps.Keys(entries)) {
		es := entries[msg]
		slices.SortStableFunc(es, func(x, y WitnessEntry) int { return cmp.Or(x.At.Compare(y.At), x.Started.Compare(y.Started)) })
		if _, ok := effects[msg]; !ok {
			c.violate(Violation{Invariant: "I2", Kind: "witness_without_effect", OrderID: es[0].OrderID, MessageID: msg,
				Detail: fmt.Sprintf("the effect log shows %s v%d handled %d times, but no shipment holds it", es[0].EventType, es[0].Version, len(es))})
		}
		for i := 1; i < len(es); i++ {
			rec, hasRec := records[msg]
			x, ok := c.explainAgain(h, run, writers, es[i-1], es[i], rec, hasRec)
			if r, held := records[msg]; ok && held && recordedBefore(h, run, writers, r, es[i]) {
				// Whatever else happened, the inbox held the message's done
				// record before this run began: its check should have
				// answered Duplicate (a redelivery after a session cut is
				// exactly what the record is for).
				ok = false
			}
			if ok {
				c.r.WitnessDuplicatesExplained++
				c.r.WitnessExplanations = append(c.r.WitnessExplanations, x)
				continue
			}
			c.r.WitnessDuplicatesUnexplained++
			c.r.DuplicateEffects++
			mode := "standalone mode, no kill of the earlier writer, no MongoDB fault, no cut of shipping's broker session and no concurrent copy explains it"
			if run.InboxTransactions {
				mode = "transaction mode: the entry commits with the inbox record"
			}
			c.violate(Violation{Invariant: "I2", Kind: "duplicate_effect", OrderID: es[i].OrderID, MessageID: msg,
				Detail: fmt.Sprintf("%s v%d handled again: entry %d by %s at %s after entry %d by %s at %s (%s)",
					es[i].EventType, es[i].Version, i+1, es[i].Writer, es[i].Started.Format(time.RFC3339Nano),
					i, es[i-1].Writer, es[i-1].At.Format(time.RFC3339Nano), mode)})
		}
	}

	for _, msg := range slices.Sorted(maps.Keys(effects)) {
		e := effects[msg]
		if e.Discarded {
			continue // an operator's skip: no handler ran, no record
		}
		es := entries[msg]
		if len(es) == 0 {
			c.violate(Violation{Invariant: "I2", Kind: "effect_without_witness", OrderID: e.OrderID, MessageID: msg,
				Detail: fmt.Sprintf("shipment holds %s v%d, the effect log shows no run of it", e.EventType, e.Version)})
		}
		if _, ok := records[msg]; ok {
			continue
		}
		if len(es) > 0 && !run.InboxTransactions {
			if _, _, ok := c.killedBeforeRecord(h, run, writers, es[len(es)-1]); ok {
				c.r.InboxRecordsLost++ // buffered when its writer was killed
				continue
			}
		}
		c.r.InboxAuditViolations++
		c.violate(Violation{Invariant: "I2", Kind: "effect_without_inbox_record", OrderID: e.OrderID, MessageID: msg,
			Detail: fmt.Sprintf("shipment holds %s v%d but the inbox has no done record of it, and no kill of its writer before the record was due explains that", e.EventType, e.Version)})
	}

	for _, msg := range slices.Sorted(maps.Keys(records)) {
		r := records[msg]
		if r.State != "done" {
			c.r.InboxAuditViolations++
			c.violate(Violation{Invariant: "I2", Kind: "inbox_record_not_done", MessageID: msg,
				Detail: fmt.Sprintf("the inbox holds a %q record after the drain (shipping takes no claims)", r.State)})
			continue
		}
		c.r.InboxRecords++
		if e, ok := effects[msg]; !ok || e.Discarded {
			c.r.InboxAuditViolations++
			c.violate(Violation{Invariant: "I2", Kind: "inbox_record_without_effect", MessageID: msg,
				Detail: fmt.Sprintf("the inbox records the message done (at %s) but no shipment holds its effect", r.ProcessedAt.Format(time.RFC3339Nano))})
		}
	}
}

// sessionCutKinds are the faults that can end a shipping consumer's broker
// session: the consumer then cancels its in-flight handlers, and one
// cancelled after its writes reached MongoDB (its error, or the write's
// lost reply, leaves no inbox record) runs again on the redelivery.
var sessionCutKinds = []FaultKind{
	FaultBrokerProxyDown, FaultBrokerProxyResetPeer, FaultBrokerProxyTimeout, FaultBrokerCloseConnections,
	FaultBrokerAppRestart, FaultNodeKill, FaultNodeKillLeader, FaultNodeAppRestart, FaultNodeProxyDown,
	FaultNodeMajorityDown, FaultNodeWipe, FaultNodePartition,
	// A paused consumer outlives its heartbeat: the broker closes its
	// connection and hands its unacked deliveries to the other consumer.
	FaultPauseShipping,
	// A broker alarm first cuts shipping from the broker (its proxies
	// disabled) to build a backlog.
	FaultBrokerAlarm,
}

// cutsShipping says f can end a shipping consumer's broker session: a
// session-cutting kind, and for a proxy fault, on shipping's proxy.
func cutsShipping(f Fault) bool {
	if !slices.Contains(sessionCutKinds, f.Kind) {
		return false
	}
	switch f.Kind {
	case FaultBrokerProxyDown, FaultBrokerProxyResetPeer, FaultBrokerProxyTimeout:
		return f.Target == "" || f.Target == TargetAMQPShipping
	}
	return true
}

// recordedBefore says the inbox held r, the message's done record, before
// later's run began: written more than the record's window before it, with
// no MongoDB fault (which can hold a buffered record back) from then on, and
// no pause of later's own consumer between a check it may have made before
// the record was written and its run.
func recordedBefore(h History, run RunInfo, writers map[string]Writer, r InboxRecord, later WitnessEntry) bool {
	if run.InboxTransactions || r.State != "done" || r.ProcessedAt.IsZero() ||
		!r.ProcessedAt.Add(run.InboxRecordWindow).Before(later.Started) {
		return false
	}
	for _, f := range h.Faults {
		switch {
		case slices.Contains(mongoFaultKinds, f.Kind) &&
			!f.Start.After(later.Started) && !f.End.Before(r.ProcessedAt.Add(-run.InboxRecordWindow)):
			return false
		case f.Kind == FaultPauseShipping && f.Target == writers[later.Writer].Proc &&
			!f.Start.After(r.ProcessedAt.Add(run.InboxRecordWindow)) && !f.End.After(later.Started):
			return false
		}
	}
	return true
}

// explainAgain says why later, a second run of earlier's message, is
// allowed, if it is. Only in standalone mode, where the inbox checks its
// record, runs the handler, then writes the record (buffered, within
// run.InboxRecordWindow):
//
//   - writer_killed: earlier's writer was SIGKILLed by a fault after
//     writing it, before its record was due (within the window, or later
//     while a MongoDB fault held the record back) and before later's run
//     began: the record died with it, the redelivery ran the handler again;
//   - record_window: later's run began within the window after earlier was
//     written: its inbox check came before the record could be there (two
//     consumers with copies of one message);
//   - run_failed: earlier's writer logged, within the window plus
//     failedRunEnd after earlier was written, that this message's run
//     failed (the inbox's or the gate's write, or the handler, failed), and
//     the done record is a later run's: the inbox recorded nothing and the
//     message came back, after a deferral and behind the queue's backlog,
//     so no clock bounds when;
//   - mongo_fault: a MongoDB fault began within the window after earlier
//     was written (its record's write was held back or cut) and later's run
//     began within the window after the fault ended, or wrote the done
//     record itself within mongoRecovery more (the fault failed earlier's
//     write; the message came back once the driver found the server);
//   - session_lost: earlier was written while a fault cut shipping's broker
//     session (from the window before the fault to the window after it):
//     the consumer cancels its in-flight handlers then, and a handler
//     cancelled after its writes landed returns an error, so the inbox
//     records nothing and the redelivery runs it again.
//
// A relay's redelivery seconds later, with no such fault, is not explained:
// that is what an inbox that deduplicates nothing does.
func (c *checker) explainAgain(h History, run RunInfo, writers map[string]Writer, earlier, later WitnessEntry, rec InboxRecord, hasRec bool) (WitnessExplanation, bool) {
	if run.InboxTransactions {
		return WitnessExplanation{}, false
	}
	x := WitnessExplanation{MessageID: later.MessageID}
	window := run.InboxRecordWindow
	if w, f, ok := c.killedBeforeRecord(h, run, writers, earlier); ok && !w.Exited.After(later.Started) && later.Writer != earlier.Writer {
		x.Reason, x.Fault = "writer_killed", faultName(f)
		x.Detail = fmt.Sprintf("%s #%d (%s) killed %s after its entry, before the run of %s began",
			w.Proc, w.Incarnation, w.ID, w.Exited.Sub(earlier.At).Round(time.Millisecond), later.Writer)
		return x, true
	}
	if d := later.Started.Sub(earlier.At); d <= window {
		x.Reason = "record_window"
		x.Detail = fmt.Sprintf("the run of %s began %s after the entry of %s, within the record's window %s",
			later.Writer, d.Round(time.Millisecond), earlier.Writer, window)
		return x, true
	}
	laterRecorded := hasRec && !rec.ProcessedAt.Before(later.Started)
	for _, f := range c.failures[later.MessageID] {
		if laterRecorded && f.Writer == earlier.Writer && !f.At.Before(earlier.At) &&
			!f.At.After(earlier.At.Add(window+failedRunEnd)) && !f.At.After(later.Started) {
			x.Reason = "run_failed"
			x.Detail = fmt.Sprintf("%s logged %q for this message %s after its entry; the run of %s handled it when it came back",
				earlier.Writer, f.Msg, f.At.Sub(earlier.At).Round(time.Millisecond), later.Writer)
			return x, true
		}
	}
	for _, f := range h.Faults {
		// later began within the window after the fault ended or, when the
		// done record is its own (the fault failed earlier's write, and
		// the message came back), within the time the driver takes to find
		// a restarted server again.
		// MongoDB faults that follow one another within the window are one
		// outage: its end is the last one's.
		if !slices.Contains(mongoFaultKinds, f.Kind) {
			continue
		}
		end := mongoOutageEnd(h, f, window)
		if !f.Start.After(earlier.At.Add(window)) && !f.End.Before(earlier.At) &&
			(!later.Started.After(end.Add(window)) || laterRecorded && !later.Started.After(end.Add(window+mongoRecovery))) {
			x.Reason, x.Fault = "mongo_fault", faultName(f)
			x.Detail = fmt.Sprintf("%s from %s to %s held back the record of the entry at %s",
				f.Kind, f.Start.Format(time.RFC3339Nano), f.End.Format(time.RFC3339Nano), earlier.At.Format(time.RFC3339Nano))
			return x, true
		}
	}
	for _, f := range h.Faults {
		if cutsShipping(f) && !earlier.At.Before(f.Start.Add(-window)) && !earlier.At.After(f.End.Add(window)) {
			x.Reason, x.Fault = "session_lost", faultName(f)
			x.Detail = fmt.Sprintf("the entry at %s was written while %s cut shipping's broker session (until %s); the run of %s handled the redelivery",
				earlier.At.Format(time.RFC3339Nano), f.Kind, f.End.Format(time.RFC3339Nano), later.Writer)
			return x, true
		}
	}
	return WitnessExplanation{}, false
}

// mongoOutageEnd is the end of the MongoDB outage f begins: f's end, moved on
// by every MongoDB fault that starts within window of it.
func mongoOutageEnd(h History, f Fault, window time.Duration) time.Time {
	end := f.End
	for moved := true; moved; {
		moved = false
		for _, g := range h.Faults {
			if slices.Contains(mongoFaultKinds, g.Kind) && !g.Start.After(end.Add(window)) && g.End.After(end) && !g.Start.Before(f.Start) {
				end, moved = g.End, true
			}
		}
	}
	return end
}

// killedBeforeRecord returns e's writer and the fault that killed it, if a
// shipping death fault on its process killed it after e was written and
// before e's record was due: within run.InboxRecordWindow, or later while
// faults that began before it could go held it back.
func (c *checker) killedBeforeRecord(h History, run RunInfo, writers map[string]Writer, e WitnessEntry) (Writer, Fault, bool) {
	w, ok := writers[e.Writer]
	if !ok || !w.Killed || w.Exited.Before(e.At) {
		return Writer{}, Fault{}, false
	}
	// A MongoDB fault holds the buffered record back; so does a pause of
	// the writer's own process (SIGSTOP freezes its flush): a fault that
	// began before the record could go moves its chance to the fault's end
	// plus the window, and holds chain (a restart of MongoDB, then a pause
	// that began before the flush after it could run).
	due := e.At.Add(run.InboxRecordWindow)
	for moved := true; moved; {
		moved = false
		for _, f := range h.Faults {
			holds := slices.Contains(mongoFaultKinds, f.Kind) || f.Kind == FaultPauseShipping && f.Target == w.Proc
			if until := f.End.Add(run.InboxRecordWindow); holds && !f.Start.After(due) && !f.End.Before(e.At) && until.After(due) {
				due, moved = until, true
			}
		}
	}
	if w.Exited.After(due) {
		return Writer{}, Fault{}, false
	}
	const slack = time.Second // the fault's recorded times bracket the kill
	for _, f := range h.Faults {
		if slices.Contains(shippingDeathKinds, f.Kind) && f.Target == w.Proc &&
			!w.Exited.Before(f.Start.Add(-slack)) && !w.Exited.After(f.End.Add(slack)) {
			return w, f, true
		}
	}
	return Writer{}, Fault{}, false
}

// faultName is "kind on target at start".
func faultName(f Fault) string {
	s := string(f.Kind)
	if f.Target != "" {
		s += " on " + f.Target
	}
	return s + " at " + f.Start.Format(time.RFC3339Nano)
}

// auditSummary is the effects audit's part of Summary, "" without one.
func (r Report) auditSummary() string {
	if !r.EffectsAudited {
		return " effects_audit=none"
	}
	return fmt.Sprintf(" absorbed_by_inbox=%d absorbed_by_version=%d witness=%d witness_again_explained=%d witness_again_unexplained=%d"+
		" inbox_records=%d inbox_records_lost=%d inbox_audit_violations=%d",
		r.DuplicatesAbsorbedInbox, r.DuplicatesAbsorbedVersion, r.WitnessEntries, r.WitnessDuplicatesExplained,
		r.WitnessDuplicatesUnexplained, r.InboxRecords, r.InboxRecordsLost, r.InboxAuditViolations)
}

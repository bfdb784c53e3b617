package chaos

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// t0w is when the witnessed baseline's entries were written.
var t0w = time.Date(2026, 11, 29, 22, 0, 10, 0, time.UTC)

// witnessed is baseline with its effects audit: each applied event (and the
// unknown event type's no-op) has one effect-log entry by shipping-1 #1,
// one stored document and one done record; standalone mode, records
// buffered for up to a second.
func witnessed() (History, FinalState, RunInfo) {
	h, s, run := baseline()
	a := &EffectsAudit{
		Writers:           []Writer{{ID: "w1/100", Proc: "shipping-1", Incarnation: 1}, {ID: "w2/200", Proc: "shipping-2", Incarnation: 1}},
		DuplicatesByLayer: map[string]int64{"inbox": 2, "version": 1},
	}
	add := func(msg, order string, version int64, typ string, at time.Time) {
		a.Effects = append(a.Effects, StoredEffect{MessageID: msg, OrderID: order, Version: version, EventType: typ})
		a.Witness = append(a.Witness, WitnessEntry{MessageID: msg, OrderID: order, Version: version, EventType: typ,
			Started: at.Add(-3 * time.Millisecond), At: at, Writer: "w1/100"})
		a.Inbox = append(a.Inbox, InboxRecord{MessageID: msg, State: "done", ProcessedAt: at.Add(time.Millisecond)})
	}
	for i, sh := range s.Shipments {
		for j, e := range sh.Events {
			add(e.MessageID, sh.OrderID, e.Version, e.EventType, t0w.Add(time.Duration(10*i+j)*time.Second))
		}
	}
	add("poison-p3", "poison-order-p3", 1, "order.unknown", t0w.Add(time.Minute))
	s.Effects = a
	run.InboxRecordWindow = time.Second
	return h, s, run
}

// again adds a second entry of message msg's effect, written by writer,
// whose run started after (later than its first entry's At).
func again(s *FinalState, msg, writer string, after time.Duration) WitnessEntry {
	i := slices.IndexFunc(s.Effects.Witness, func(e WitnessEntry) bool { return e.MessageID == msg })
	e := s.Effects.Witness[i]
	e.Started = e.At.Add(after)
	e.At = e.Started.Add(2 * time.Millisecond)
	e.Writer = writer
	s.Effects.Witness = append(s.Effects.Witness, e)
	// The earlier run left no record (it died, or was cancelled, first):
	// the done record is the later run's.
	r := slices.IndexFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == msg })
	s.Effects.Inbox[r].ProcessedAt = e.At.Add(time.Millisecond)
	return e
}

// killed records that writer w1 (shipping-1 #1) was SIGKILLed at at, by a
// fault of kind.
func killed(h *History, s *FinalState, kind FaultKind, at time.Time) {
	s.Effects.Writers[0].Exited, s.Effects.Writers[0].Killed = at, true
	h.Faults = append(h.Faults, Fault{Kind: kind, Target: "shipping-1", Start: at.Add(-time.Millisecond), End: at.Add(500 * time.Millisecond)})
}

func TestAuditPassesAWitnessedRun(t *testing.T) {
	h, s, run := witnessed()
	r := Check(h, s, run)
	if !r.OK {
		t.Fatalf("Check: %v", r.Violations)
	}
	if !r.EffectsAudited || r.WitnessEntries != 5 || r.InboxRecords != 5 || r.DuplicatesAbsorbedInbox != 2 ||
		r.DuplicatesAbsorbedVersion != 1 || r.WitnessDuplicatesExplained != 0 || r.WitnessDuplicatesUnexplained != 0 {
		t.Errorf("report %+v", r)
	}
	if sum := r.Summary(); !strings.Contains(sum, " absorbed_by_inbox=2 absorbed_by_version=1 witness=5 witness_again_explained=0 witness_again_unexplained=0 inbox_records=5 ") {
		t.Errorf("Summary() = %q", sum)
	}
	s.Effects = nil
	if r := Check(h, s, run); !r.OK || r.EffectsAudited {
		t.Errorf("without an audit: ok=%v audited=%v", r.OK, r.EffectsAudited)
	}
}

// Each way the effect log or the inbox can show a bug, on its own.
func TestAuditCatchesEachBug(t *testing.T) {
	tests := []struct {
		name    string
		break_  func(h *History, s *FinalState, run *RunInfo)
		kind    string
		message string
	}{
		{"a message handled twice, 5s apart, no fault (an inbox that deduplicates nothing)", func(h *History, s *FinalState, run *RunInfo) {
			again(s, "2", "w2/200", 5*time.Second)
		}, "duplicate_effect", "2"},
		{"the same message handled twice by one process run", func(h *History, s *FinalState, run *RunInfo) {
			again(s, "2", "w1/100", 5*time.Second)
		}, "duplicate_effect", "2"},
		{"the earlier writer killed in between, in transaction mode", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w2/200", 5*time.Second)
			killed(h, s, FaultKillShipping, e.Started.Add(-4990*time.Millisecond))
			run.InboxTransactions = true
		}, "duplicate_effect", "2"},
		{"the earlier writer killed long after its record was due (a relay's redelivery later)", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w2/200", 30*time.Second)
			killed(h, s, FaultKillShipping, e.Started.Add(-5*time.Second))
		}, "duplicate_effect", "2"},
		{"the earlier writer killed after the later run began", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w2/200", 5*time.Second)
			killed(h, s, FaultKillShipping, e.Started.Add(time.Second))
		}, "duplicate_effect", "2"},
		{"the earlier writer died with no fault to say so", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w2/200", 5*time.Second)
			killed(h, s, FaultKillShipping, e.Started.Add(-4990*time.Millisecond))
			h.Faults = h.Faults[:len(h.Faults)-1]
		}, "duplicate_effect", "2"},
		{"copies within the record's window, in transaction mode", func(h *History, s *FinalState, run *RunInfo) {
			again(s, "2", "w2/200", -time.Millisecond)
			run.InboxTransactions = true
		}, "duplicate_effect", "2"},
		{"a failure logged by another writer", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w1/100", 48*time.Second)
			s.Effects.Failures = append(s.Effects.Failures, RunFailure{MessageID: "2", Writer: "w2/200",
				At: e.Started.Add(-47 * time.Second), Msg: "inbox failed, deferring the message"})
		}, "duplicate_effect", "2"},
		{"a failure logged long after the earlier run's entry", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w1/100", 48*time.Second)
			s.Effects.Failures = append(s.Effects.Failures, RunFailure{MessageID: "2", Writer: "w1/100",
				At: e.Started.Add(-14 * time.Second), Msg: "inbox failed, deferring the message"})
		}, "duplicate_effect", "2"},
		{"a failure logged while the earlier run's record is there", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w1/100", 48*time.Second)
			r := slices.IndexFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "2" })
			s.Effects.Inbox[r].ProcessedAt = e.Started.Add(-48*time.Second + 2*time.Millisecond)
			s.Effects.Failures = append(s.Effects.Failures, RunFailure{MessageID: "2", Writer: "w1/100",
				At: e.Started.Add(-47 * time.Second), Msg: "MongoDB unavailable, keeping the delivery until it is back"})
		}, "duplicate_effect", "2"},
		{"a MongoDB fault long before the later run", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w2/200", 20*time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultMongoRestart, Start: e.Started.Add(-20 * time.Second), End: e.Started.Add(-15 * time.Second)})
		}, "duplicate_effect", "2"},
		{"a broker cut of the orders API's connection only", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w1/100", 8*time.Second)
			at := e.Started.Add(-8 * time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultBrokerProxyResetPeer, Target: TargetAMQPOrders, Start: at.Add(200 * time.Millisecond), End: at.Add(3 * time.Second)})
		}, "duplicate_effect", "2"},
		{"shipping's broker session cut long after the earlier entry", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w1/100", 8*time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultBrokerProxyDown, Target: TargetAMQPShipping, Start: e.Started.Add(-5 * time.Second), End: e.Started.Add(-3 * time.Second)})
		}, "duplicate_effect", "2"},
		{"shipping's broker session cut while the handler wrote, in transaction mode", func(h *History, s *FinalState, run *RunInfo) {
			e := again(s, "2", "w1/100", 8*time.Second)
			at := e.Started.Add(-8 * time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultBrokerCloseConnections, Start: at, End: at.Add(time.Second)})
			run.InboxTransactions = true
		}, "duplicate_effect", "2"},
		{"a done record without its effect", func(h *History, s *FinalState, run *RunInfo) {
			s.Effects.Inbox = append(s.Effects.Inbox, InboxRecord{MessageID: "77", State: "done", ProcessedAt: t0w})
		}, "inbox_record_without_effect", "77"},
		{"an applied effect without its done record", func(h *History, s *FinalState, run *RunInfo) {
			s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
		}, "effect_without_inbox_record", "4"},
		{"an applied effect without its done record, its writer killed at once, in transaction mode", func(h *History, s *FinalState, run *RunInfo) {
			s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
			killed(h, s, FaultKillShipping, t0w.Add(11*time.Second+5*time.Millisecond))
			run.InboxTransactions = true
		}, "effect_without_inbox_record", "4"},
		{"an applied effect without its done record, its writer killed a minute later", func(h *History, s *FinalState, run *RunInfo) {
			s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
			killed(h, s, FaultKillShipping, t0w.Add(71*time.Second))
		}, "effect_without_inbox_record", "4"},
		{"an effect the log does not show", func(h *History, s *FinalState, run *RunInfo) {
			s.Effects.Witness = slices.DeleteFunc(s.Effects.Witness, func(e WitnessEntry) bool { return e.MessageID == "3" })
		}, "effect_without_witness", "3"},
		{"an effect-log entry without its effect", func(h *History, s *FinalState, run *RunInfo) {
			s.Effects.Witness = append(s.Effects.Witness, WitnessEntry{MessageID: "88", OrderID: "o1", Version: 2,
				EventType: EventCancelled, Started: t0w, At: t0w, Writer: "w1/100"})
		}, "witness_without_effect", "88"},
		{"a claim left in the inbox", func(h *History, s *FinalState, run *RunInfo) {
			s.Effects.Inbox[0].State = "processing"
		}, "inbox_record_not_done", "1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, s, run := witnessed()
			tt.break_(&h, &s, &run)
			r := Check(h, s, run)
			found := slices.ContainsFunc(r.Violations, func(v Violation) bool {
				return v.Invariant == "I2" && v.Kind == tt.kind && v.MessageID == tt.message
			})
			if !found || r.OK {
				t.Fatalf("want I2 %s of message %s; got %v", tt.kind, tt.message, r.Violations)
			}
			if tt.kind == "duplicate_effect" && (r.DuplicateEffects != 1 || r.WitnessDuplicatesUnexplained != 1 || r.WitnessDuplicatesExplained != 0) {
				t.Errorf("duplicate_effects=%d unexplained=%d explained=%d; want 1, 1, 0",
					r.DuplicateEffects, r.WitnessDuplicatesUnexplained, r.WitnessDuplicatesExplained)
			}
			if tt.kind != "duplicate_effect" && r.InboxAuditViolations == 0 && tt.kind != "effect_without_witness" && tt.kind != "witness_without_effect" {
				t.Errorf("inbox_audit_violations = 0")
			}
		})
	}
}

// What standalone mode allows, each explained by what the history shows.
func TestAuditExplainsWhatStandaloneAllows(t *testing.T) {
	tests := []struct {
		name   string
		change func(h *History, s *FinalState)
		reason string
		lost   int
	}{
		{"the earlier writer killed before its record was written, the redelivery handled again", func(h *History, s *FinalState) {
			e := again(s, "2", "w2/200", 5*time.Second)
			killed(h, s, FaultKillShipping, e.Started.Add(-4990*time.Millisecond))
		}, "writer_killed", 0},
		{"the earlier writer died at the crash point after the effect", func(h *History, s *FinalState) {
			e := again(s, "2", "w2/200", 5*time.Second)
			killed(h, s, FaultCrashShippingAfterEffect, e.Started.Add(-4999*time.Millisecond))
		}, "writer_killed", 0},
		{"two consumers ran copies before either record was written", func(h *History, s *FinalState) {
			again(s, "2", "w2/200", 4*time.Millisecond)
		}, "record_window", 0},
		{"a MongoDB outage held the buffered record back while a copy was handled", func(h *History, s *FinalState) {
			e := again(s, "2", "w2/200", 8*time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultMongoProxyDown, Start: e.Started.Add(-8*time.Second + 5*time.Millisecond), End: e.Started.Add(-500 * time.Millisecond)})
		}, "mongo_fault", 0},
		{"shipping's broker session cut while the handler wrote: its cancelled run recorded nothing, the redelivery ran again", func(h *History, s *FinalState) {
			e := again(s, "2", "w1/100", 8*time.Second)
			at := e.Started.Add(-8 * time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultBrokerProxyResetPeer, Target: TargetAMQPShipping, Start: at.Add(200 * time.Millisecond), End: at.Add(3 * time.Second)})
		}, "session_lost", 0},
		{"a broker alarm's first phase cut shipping from the broker while the handler wrote: the redelivery ran again", func(h *History, s *FinalState) {
			e := again(s, "2", "w1/100", 8*time.Second)
			at := e.Started.Add(-8 * time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultBrokerAlarm, Target: "node-3", Start: at.Add(-3 * time.Second), End: at.Add(20 * time.Second)})
		}, "session_lost", 0},
		{"the consumer paused past its heartbeat after the handler wrote: the other consumer ran the redelivery", func(h *History, s *FinalState) {
			e := again(s, "2", "w2/200", 14*time.Second)
			at := e.Started.Add(-14 * time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultPauseShipping, Target: "shipping-0", Start: at.Add(300 * time.Millisecond), End: at.Add(12 * time.Second)})
		}, "session_lost", 0},
		{"a MongoDB outage failed the record's write; the redelivery came seconds after it ended and wrote the record", func(h *History, s *FinalState) {
			e := again(s, "2", "w1/100", 9*time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultMongoDiskFull, Start: e.Started.Add(-9*time.Second - time.Second), End: e.Started.Add(-4 * time.Second)})
		}, "mongo_fault", 0},
		{"the earlier run logged its failure after its effect; the message came back behind a backlog long after", func(h *History, s *FinalState) {
			e := again(s, "2", "w2/200", 48*time.Second)
			s.Effects.Failures = append(s.Effects.Failures, RunFailure{MessageID: "2", Writer: "w1/100",
				At: e.Started.Add(-47 * time.Second), Msg: "inbox failed, deferring the message"})
		}, "run_failed", 0},
		{"the earlier run's write waited for the server selection before it failed", func(h *History, s *FinalState) {
			e := again(s, "2", "w2/200", 24*time.Second)
			s.Effects.Failures = append(s.Effects.Failures, RunFailure{MessageID: "2", Writer: "w1/100",
				At: e.Started.Add(-24*time.Second + 6*time.Second), Msg: "inbox failed, deferring the message"})
		}, "run_failed", 0},
		{"MongoDB faults one after another held the record back; the redelivery came after the last", func(h *History, s *FinalState) {
			e := again(s, "2", "w1/100", 30*time.Second)
			at := e.Started.Add(-30 * time.Second)
			h.Faults = append(h.Faults,
				Fault{Kind: FaultMongoAckLoss, Start: at.Add(-time.Second), End: at.Add(7 * time.Second)},
				Fault{Kind: FaultMongoRestart, Start: at.Add(8 * time.Second), End: at.Add(15 * time.Second)},
				Fault{Kind: FaultMongoDiskFull, Start: at.Add(16 * time.Second), End: at.Add(29 * time.Second)})
		}, "mongo_fault", 0},
		{"a MongoDB reply lost after the record's write landed elsewhere: the copy ran again", func(h *History, s *FinalState) {
			e := again(s, "2", "w2/200", 6*time.Second)
			h.Faults = append(h.Faults, Fault{Kind: FaultMongoAckLoss, Start: e.Started.Add(-6*time.Second + 5*time.Millisecond), End: e.Started.Add(-time.Second)})
		}, "mongo_fault", 0},
		{"a buffered record lost with its writer, acked, never delivered again", func(h *History, s *FinalState) {
			s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
			killed(h, s, FaultKillShipping, t0w.Add(11*time.Second+5*time.Millisecond))
		}, "", 1},
		{"a MongoDB restart held the record, a pause of its writer began before it could go, the writer killed as it resumed", func(h *History, s *FinalState) {
			s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
			h.Faults = append(h.Faults,
				Fault{Kind: FaultMongoRestart, Start: t0w.Add(11*time.Second + 500*time.Millisecond), End: t0w.Add(19 * time.Second)},
				Fault{Kind: FaultPauseShipping, Target: "shipping-1", Start: t0w.Add(19*time.Second + 500*time.Millisecond), End: t0w.Add(42 * time.Second)})
			killed(h, s, FaultKillShipping, t0w.Add(42*time.Second+2*time.Millisecond))
		}, "", 1},
		{"a buffered record frozen with its writer by a pause, the writer killed as it resumed", func(h *History, s *FinalState) {
			s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
			h.Faults = append(h.Faults, Fault{Kind: FaultPauseShipping, Target: "shipping-1", Start: t0w.Add(11*time.Second + 200*time.Millisecond), End: t0w.Add(35 * time.Second)})
			killed(h, s, FaultKillShipping, t0w.Add(35*time.Second+time.Millisecond))
		}, "", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, s, run := witnessed()
			tt.change(&h, &s)
			r := Check(h, s, run)
			if !r.OK {
				t.Fatalf("Check: %v", r.Violations)
			}
			if r.InboxRecordsLost != tt.lost {
				t.Errorf("inbox_records_lost = %d, want %d", r.InboxRecordsLost, tt.lost)
			}
			if tt.reason == "" {
				return
			}
			if r.WitnessDuplicatesExplained != 1 || len(r.WitnessExplanations) != 1 || r.WitnessExplanations[0].Reason != tt.reason ||
				r.WitnessExplanations[0].MessageID != "2" {
				t.Errorf("explained %d: %+v; want one, %s", r.WitnessDuplicatesExplained, r.WitnessExplanations, tt.reason)
			}
		})
	}
}

// An inbox that deduplicates nothing runs a redelivery again although its
// done record was there: a cut of shipping's broker session (or a pause)
// explains a redelivery, not a second run past a record the check should
// have found.
func TestAuditDoesNotExcuseARunPastItsDoneRecord(t *testing.T) {
	for _, kind := range []FaultKind{FaultBrokerCloseConnections, FaultPauseShipping} {
		h, s, run := witnessed()
		i := slices.IndexFunc(s.Effects.Witness, func(e WitnessEntry) bool { return e.MessageID == "2" })
		first := s.Effects.Witness[i]
		e := first
		e.Started = first.At.Add(8 * time.Second)
		e.At = e.Started.Add(2 * time.Millisecond)
		e.Writer = "w2/200"                              // the other consumer took the redelivery
		s.Effects.Witness = append(s.Effects.Witness, e) // the record stays the first run's
		h.Faults = append(h.Faults, Fault{Kind: kind, Target: "shipping-1", Start: first.At.Add(-200 * time.Millisecond), End: first.At.Add(-100 * time.Millisecond)})
		if kind == FaultBrokerCloseConnections {
			h.Faults[len(h.Faults)-1].End = first.At.Add(3 * time.Second)
		}
		r := Check(h, s, run)
		if r.WitnessDuplicatesUnexplained != 1 || r.DuplicateEffects != 1 {
			t.Errorf("%s: unexplained %d, duplicate_effects %d, explained %+v; want the second run unexplained",
				kind, r.WitnessDuplicatesUnexplained, r.DuplicateEffects, r.WitnessExplanations)
		}
	}
}

// A pause explains a lost record only when the writer is killed before it
// could flush after resuming: killed well past the record's window after the
// pause ended, the record should have been written.
func TestAuditDoesNotExcuseALostRecordLongAfterAPause(t *testing.T) {
	h, s, run := witnessed()
	s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
	h.Faults = append(h.Faults, Fault{Kind: FaultPauseShipping, Target: "shipping-1", Start: t0w.Add(11*time.Second + 200*time.Millisecond), End: t0w.Add(35 * time.Second)})
	killed(&h, &s, FaultKillShipping, t0w.Add(45*time.Second))
	r := Check(h, s, run)
	if r.OK || r.InboxAuditViolations != 1 || r.InboxRecordsLost != 0 {
		t.Errorf("ok %v, inbox_audit_violations %d, inbox_records_lost %d; want the lost record a violation", r.OK, r.InboxAuditViolations, r.InboxRecordsLost)
	}
}

// Holds chain only while the record is still held: a pause that begins
// after the record could have gone (a MongoDB restart's end plus the
// window) explains nothing.
func TestAuditDoesNotChainAHoldPastTheRecordsChance(t *testing.T) {
	h, s, run := witnessed()
	s.Effects.Inbox = slices.DeleteFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "4" })
	h.Faults = append(h.Faults,
		Fault{Kind: FaultMongoRestart, Start: t0w.Add(11*time.Second + 500*time.Millisecond), End: t0w.Add(19 * time.Second)},
		Fault{Kind: FaultPauseShipping, Target: "shipping-1", Start: t0w.Add(21 * time.Second), End: t0w.Add(42 * time.Second)})
	killed(&h, &s, FaultKillShipping, t0w.Add(42*time.Second+2*time.Millisecond))
	r := Check(h, s, run)
	if r.OK || r.InboxAuditViolations != 1 || r.InboxRecordsLost != 0 {
		t.Errorf("ok %v, inbox_audit_violations %d, inbox_records_lost %d; want the lost record a violation", r.OK, r.InboxAuditViolations, r.InboxRecordsLost)
	}
}

// A MongoDB fault explains a run long after it only when that run wrote the
// done record: a record the earlier run wrote means the fault failed nothing.
func TestAuditDoesNotExcuseALateRunWhenTheEarlierRecorded(t *testing.T) {
	h, s, run := witnessed()
	e := again(&s, "2", "w1/100", 9*time.Second)
	r := slices.IndexFunc(s.Effects.Inbox, func(r InboxRecord) bool { return r.MessageID == "2" })
	first := slices.IndexFunc(s.Effects.Witness, func(w WitnessEntry) bool { return w.MessageID == "2" })
	s.Effects.Inbox[r].ProcessedAt = s.Effects.Witness[first].At.Add(time.Millisecond) // the earlier run's record
	h.Faults = append(h.Faults, Fault{Kind: FaultMongoDiskFull, Start: e.Started.Add(-9*time.Second - time.Second), End: e.Started.Add(-4 * time.Second)})
	if rep := Check(h, s, run); rep.WitnessDuplicatesUnexplained != 1 {
		t.Errorf("unexplained %d, explained %+v; want the late run unexplained", rep.WitnessDuplicatesUnexplained, rep.WitnessExplanations)
	}
}

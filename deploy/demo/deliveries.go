package main

import (
	"bytes"
	"encoding/json"
	"sync"
	"time"
)

// deliveryLog counts what the shipping service did with each delivery, read
// from its own log: the demo runs it with LOG_LEVEL=debug, and it logs one
// debug line per delivery it settles ("applied", "duplicate (inbox)",
// "duplicate (already applied)", "deferred"), with the message id. Those
// lines feed the live view and are kept off the terminal, which shows what it
// showed at the info level.
type deliveryLog struct {
	mu sync.Mutex
	// counts since the demo started
	delivered, applied, dupInbox, dupVersion, deferred int64
	// per message id, the most recent maxTracked messages
	byID  map[string][]delivery
	order []string
}

// delivery is one settled delivery of a message, as shipping logged it.
type delivery struct {
	At      time.Time `json:"at"`
	Outcome string    `json:"outcome"`
}

// maxTracked bounds the per-message history the journey view can show.
const maxTracked = 20_000

func newDeliveryLog() *deliveryLog {
	return &deliveryLog{byID: map[string][]delivery{}}
}

// outcomes maps shipping's debug messages to the live view's outcomes.
var outcomes = map[string]string{
	"applied":                     "applied",
	"duplicate (inbox)":           "duplicate (inbox)",
	"duplicate (already applied)": "duplicate (version)",
	"deferred":                    "deferred",
}

// line reads one line of the shipping service's output and reports whether
// the terminal should show it: debug lines are the live view's alone.
func (l *deliveryLog) line(b []byte) bool {
	b = bytes.TrimSpace(b)
	if len(b) == 0 || b[0] != '{' || !bytes.Contains(b, []byte(`"DEBUG"`)) {
		return true
	}
	var rec struct {
		Time    time.Time `json:"time"`
		Level   string    `json:"level"`
		Msg     string    `json:"msg"`
		EventID string    `json:"event_id"`
	}
	if err := json.Unmarshal(b, &rec); err != nil || rec.Level != "DEBUG" {
		return true
	}
	outcome, ok := outcomes[rec.Msg]
	if !ok || rec.EventID == "" {
		return false
	}
	l.record(rec.EventID, delivery{At: rec.Time, Outcome: outcome})
	return false
}

func (l *deliveryLog) record(id string, d delivery) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.delivered++
	switch d.Outcome {
	case "applied":
		l.applied++
	case "duplicate (inbox)":
		l.dupInbox++
	case "duplicate (version)":
		l.dupVersion++
	case "deferred":
		l.deferred++
	}
	if _, seen := l.byID[id]; !seen {
		l.order = append(l.order, id)
		if len(l.order) > maxTracked {
			delete(l.byID, l.order[0])
			l.order = l.order[1:]
		}
	}
	l.byID[id] = append(l.byID[id], d)
}

// deliveryCounts is what the live view shows of the log.
type deliveryCounts struct {
	Delivered         int64 `json:"delivered"`
	Applied           int64 `json:"applied"`
	DuplicatesInbox   int64 `json:"duplicates_inbox"`
	DuplicatesVersion int64 `json:"duplicates_version"`
	Deferred          int64 `json:"deferred"`
}

func (l *deliveryLog) counts() deliveryCounts {
	l.mu.Lock()
	defer l.mu.Unlock()
	return deliveryCounts{
		Delivered: l.delivered, Applied: l.applied,
		DuplicatesInbox: l.dupInbox, DuplicatesVersion: l.dupVersion, Deferred: l.deferred,
	}
}

func (l *deliveryLog) of(id string) []delivery {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]delivery(nil), l.byID[id]...)
}

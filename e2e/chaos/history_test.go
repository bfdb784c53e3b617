package chaos

import (
	"testing"
	"time"
)

// A crash point's clock (e2e) counts the acknowledged operations that started
// after its arming: neither a failed or unknown one nor one started before.
func TestAcknowledgedSince(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var r Recorder
	r.Op(Op{Kind: OpCreate, Outcome: OutcomeOK, Start: t0.Add(-time.Second)})
	r.Op(Op{Kind: OpCreate, Outcome: OutcomeOK, Start: t0})
	r.Op(Op{Kind: OpAmend, Outcome: OutcomeOK, Start: t0.Add(time.Second)})
	r.Op(Op{Kind: OpCreate, Outcome: OutcomeUnknown, Start: t0.Add(time.Second)})
	r.Op(Op{Kind: OpCancel, Outcome: OutcomeFailed, Start: t0.Add(2 * time.Second)})
	if got := r.AcknowledgedSince(t0); got != 2 {
		t.Errorf("AcknowledgedSince = %d, want 2", got)
	}
	if got := r.AcknowledgedSince(t0.Add(time.Hour)); got != 0 {
		t.Errorf("AcknowledgedSince(later) = %d, want 0", got)
	}
}

package crashpoint

import "testing"

func TestTriggerFiresOnNthHitOfItsPointOnly(t *testing.T) {
	var fired int
	tr := New(RelayAfterPublishBeforeMark, 3, func() { fired++ })
	tr.Hit(ShippingAfterInboxBeforeAck)
	tr.Hit(RelayAfterPublishBeforeMark)
	tr.Hit(RelayAfterPublishBeforeMark)
	if fired != 0 {
		t.Fatalf("fired after 2 hits, want on the 3rd")
	}
	tr.Hit(RelayAfterPublishBeforeMark)
	tr.Hit(RelayAfterPublishBeforeMark)
	if fired != 1 {
		t.Fatalf("fired %d times, want once", fired)
	}
}

func TestNilTriggerIsNoOp(t *testing.T) {
	var tr *Trigger
	tr.Hit(RelayAfterPublishBeforeMark)
}

func TestFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	if tr, err := FromEnv(env(nil)); tr != nil || err != nil {
		t.Fatalf("unset: %v %v", tr, err)
	}
	if _, err := FromEnv(env(map[string]string{"CRASH_POINT": "relay.typo"})); err == nil {
		t.Fatal("unknown point accepted")
	}
	if _, err := FromEnv(env(map[string]string{"CRASH_POINT": RelayAfterPublishBeforeMark, "CRASH_AFTER": "0"})); err == nil {
		t.Fatal("CRASH_AFTER=0 accepted")
	}
	tr, err := FromEnv(env(map[string]string{"CRASH_POINT": OrdersAfterCommitBeforeResponse, "CRASH_AFTER": "2"}))
	if err != nil || tr.point != OrdersAfterCommitBeforeResponse || tr.after != 2 {
		t.Fatalf("got %+v, %v", tr, err)
	}
}

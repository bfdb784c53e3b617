package main

import (
	"io"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/services/shipping/accounting"
)

// A message shipping still defers (waiting for an earlier version of its
// order, or after its inbox failed by itself) is on its way for up to its
// -max-deferral-age, 30 minutes by default, and then dead-lettered (held):
// a grace shorter than that reports messages still being retried as
// missing. The default grace is derived from the deferral cap.
func TestDefaultGraceOutlastsShippingsDeferrals(t *testing.T) {
	t.Parallel()
	noenv := func(string) string { return "" }
	for _, tc := range []struct {
		args     []string
		deferral time.Duration
	}{
		{nil, accounting.DefaultMaxDeferralAge},
		{[]string{"-max-deferral-age", "2h"}, 2 * time.Hour},
		{[]string{"-max-deferral-age", "1m", "-retention", "1h"}, time.Minute},
	} {
		o, err := parse(tc.args, noenv, io.Discard)
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if o.grace <= tc.deferral {
			t.Errorf("%v: grace %v, not longer than shipping's deferrals (%v)", tc.args, o.grace, tc.deferral)
		}
	}
	o, err := parse([]string{"-max-deferral-age", "2h", "-grace", "1m"}, noenv, io.Discard)
	if err != nil || o.grace != time.Minute {
		t.Fatalf("-grace 1m: grace %v, %v; want 1m: a grace given wins", o.grace, err)
	}
}

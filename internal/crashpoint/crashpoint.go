// Package crashpoint lets the end-to-end suite kill a service at a precise point
// of its protocol, e.g. after a publish was confirmed but before the row was
// marked, to prove that recovery from exactly that point is correct.
//
// A process arms one point from its environment:
//
//	CRASH_POINT=relay.after_publish_before_mark CRASH_AFTER=3
//
// The third time the relay reaches that point, the process sends itself SIGKILL:
// no deferred function, no graceful shutdown, like a power cut. Unset, every
// Hit is a cheap no-op.
package crashpoint

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"
)

// The named points. Services call Hit with one of these.
const (
	OrdersAfterCommitBeforeResponse = "orders.after_commit_before_response"
	RelayAfterPublishBeforeMark     = "relay.after_publish_before_mark"
	ShippingAfterEffectBeforeInbox  = "shipping.after_effect_before_inbox"
	ShippingAfterInboxBeforeAck     = "shipping.after_inbox_before_ack"
	// ShippingReleaseAfterPublish: a dead letter's release re-published a
	// parked message (confirmed) and has not deleted its parked copy yet.
	ShippingReleaseAfterPublish = "shipping.release_after_publish"
)

// Points lists every named point.
func Points() []string {
	return []string{
		OrdersAfterCommitBeforeResponse,
		RelayAfterPublishBeforeMark,
		ShippingAfterEffectBeforeInbox,
		ShippingAfterInboxBeforeAck,
		ShippingReleaseAfterPublish,
	}
}

// Trigger kills the process at its armed point. The zero value (and nil) never
// fires.
type Trigger struct {
	point string
	after int64
	hits  atomic.Int64
	kill  func()
}

// FromEnv returns the Trigger armed by CRASH_POINT and CRASH_AFTER (default 1).
// It returns nil when CRASH_POINT is unset, and an error for an unknown point or
// a bad count, so a typo in a test never silently disarms it.
func FromEnv(getenv func(string) string) (*Trigger, error) {
	point := getenv("CRASH_POINT")
	if point == "" {
		return nil, nil
	}
	if !slices.Contains(Points(), point) {
		return nil, fmt.Errorf("CRASH_POINT %q: unknown point (known: %v)", point, Points())
	}
	after := int64(1)
	if s := getenv("CRASH_AFTER"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("CRASH_AFTER %q: want a positive integer", s)
		}
		after = n
	}
	return New(point, after, killSelf), nil
}

// New returns a Trigger that calls kill the after-th time point is hit.
func New(point string, after int64, kill func()) *Trigger {
	return &Trigger{point: point, after: after, kill: kill}
}

// Hit records that the process reached point, and fires if it is the armed
// point's after-th hit.
func (t *Trigger) Hit(point string) {
	if t == nil || t.point != point {
		return
	}
	if t.hits.Add(1) == t.after {
		t.kill()
	}
}

func killSelf() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL cannot be caught; never return into the protocol.
}

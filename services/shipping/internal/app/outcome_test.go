package app_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/processor"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// refusingInbox fails, by itself, every message of one order: with
// inbox.ErrTransient (a transaction that kept failing transiently), or with
// a database error that is not the handler's (Unauthorized).
type refusingInbox struct {
	processor.Inbox
	order string
	err   error
}

func (r refusingInbox) Process(ctx context.Context, msgID string, pos inbox.Position, h inbox.Handler) (inbox.Result, error) {
	if strings.HasPrefix(msgID, r.order+"-") {
		return 0, r.err
	}
	return r.Inbox.Process(ctx, msgID, pos, h)
}

// A message the inbox keeps failing on ends: after MaxTransientDeferrals
// trips through the delay queue it is dead-lettered as inbox_failed, with
// its count, while the other orders flow.
func TestMessageTheInboxKeepsFailingOnEndsAsADeadLetter(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		err    error
		reason string
	}{
		"transient": {&inbox.TransientError{MessageID: "x", Attempts: 184, Elapsed: 90 * time.Second,
			Err: mongo.CommandError{Code: 251, Name: "NoSuchTransaction", Labels: []string{"TransientTransactionError"}}}, "transient"},
		"unauthorized": {fmt.Errorf("inbox: read record x: %w", mongo.CommandError{Code: 13, Name: "Unauthorized", Message: "not authorized on shipping"}), "database"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			a := e.start(app.Config{
				MaxTransientDeferrals: 3,
				WrapInbox:             func(in processor.Inbox) processor.Inbox { return refusingInbox{in, "9", tc.err} },
			})
			e.pub.publish(created("9-1", "stuck-"+name))
			e.pub.publish(created("free-1", "free-"+name))
			wantEvents(t, e.waitShipment("free-"+name, 1), "free-1")

			var dead []string
			waitFor(t, 60*time.Second, "the message dead-lettered", func() bool {
				for _, d := range e.deadLetters(a.Topology().DeadLetterQueue) {
					dead = append(dead, fmt.Sprintf("%s %v %v", d.MessageId, d.Headers["x-dead-letter-reason"], d.Headers[processor.HeaderTransientDeferrals]))
				}
				return len(dead) > 0
			})
			if want := "9-1 inbox_failed 3"; len(dead) != 1 || dead[0] != want {
				t.Fatalf("dead letters %q, want %q", dead, want)
			}
			wantCounted(t, "deferrals "+tc.reason, a.Metrics().Deferred.WithLabelValues(tc.reason), 3)
			wantCounted(t, "dead letters inbox_failed", a.Metrics().DeadLettered.WithLabelValues(string(shipment.ReasonInboxFailed)), 1)
			e.waitDrained(a)
		})
	}
}

// blockingStore holds every Apply of one order until released.
type blockingStore struct {
	processor.Store
	orders  []string
	entered chan<- struct{}
	release <-chan struct{}
}

func (b blockingStore) Apply(ctx context.Context, msgID string, ev shipment.Event) (shipment.Outcome, error) {
	if slices.Contains(b.orders, ev.OrderID) {
		b.entered <- struct{}{}
		select {
		case <-b.release:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return b.Store.Apply(ctx, msgID, ev)
}

// /readyz answers 503 while every worker has been on one delivery for longer
// than StuckAfter, and 200 again once one of them is free.
func TestReadyzIsNotReadyWhileEveryWorkerIsStuck(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// An order's deliveries all go to one worker: the orders are picked on
	// the two workers' lanes.
	slow := "slow"
	other := otherLane(slow, "other-%d")
	slowToo := otherLane(slow, "slow-%d")
	entered, release := make(chan struct{}, 4), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	a := e.start(app.Config{
		Concurrency: 2, StuckAfter: 300 * time.Millisecond,
		WrapStore: func(s processor.Store) processor.Store {
			return blockingStore{s, []string{slow, slowToo}, entered, release}
		},
	})
	readyz := "http://" + a.HTTPAddr() + "/readyz"

	e.pub.publish(created("2001", slow))
	<-entered // one worker stuck, the other free
	e.pub.publish(created("2011", other))
	e.waitShipment(other, 1)
	// The other worker is free once it acked "other", a moment after its
	// shipment shows.
	waitFor(t, 30*time.Second, "/readyz 200 with one worker of two busy", func() bool {
		code, _, _ := get(t, readyz)
		return code == http.StatusOK
	})
	e.pub.publish(created("2021", slowToo)) // takes the second worker
	<-entered
	var body string
	waitFor(t, 30*time.Second, "/readyz 503 naming the workers", func() bool {
		var code int
		code, _, body = get(t, readyz)
		return code == http.StatusServiceUnavailable && strings.Contains(body, `"workers"`)
	})
	if !strings.Contains(body, "all 2 workers stuck") {
		t.Errorf("/readyz body %s: want it to say the workers are stuck", body)
	}
	free()
	waitFor(t, 30*time.Second, "/readyz 200 once the workers are free", func() bool {
		code, _, _ := get(t, readyz)
		return code == http.StatusOK
	})
	e.pub.publish(cancelled("2002", slow))
	wantEvents(t, e.waitShipment(slow, 2), "2001", "2002")
	wantEvents(t, e.waitShipment(slowToo, 1), "2021")
}

// otherLane returns the first order named by format (with 0, 1, ...) that
// is not on order's lane of two workers.
func otherLane(order, format string) string {
	for i := 0; ; i++ {
		if id := fmt.Sprintf(format, i); rabbitmq.Lane(id, 2) != rabbitmq.Lane(order, 2) {
			return id
		}
	}
}

package outboxamqp_test

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// PublishBatchTimed reports when each message's confirm was seen, returned
// ones included (their ack follows the return), for a tracing decorator to
// end each message's span there; Node names the node connected to, for
// server.address and server.port.
func TestPublishBatchTimedReportsEachConfirmAndTheNode(t *testing.T) {
	t.Parallel()
	b := newBroker(t, false)
	b.bind("order.created", nil)
	p := newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil))
	if host, port := p.Node(); host != "" || port != 0 {
		t.Errorf("Node before any connection = %q, %d; want none", host, port)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(testAMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	wantPort, _ := strconv.Atoi(u.Port())
	if wantPort == 0 {
		wantPort = 5672
	}
	if host, port := p.Node(); host != u.Hostname() || port != wantPort {
		t.Errorf("Node = %q, %d; want %s, %d", host, port, u.Hostname(), wantPort)
	}

	msgs := []outbox.Envelope{
		envelope(1, "o-1", 1, "order.created"),
		envelope(2, "o-2", 1, "order.cancelled"), // unroutable: returned, then acked
		envelope(3, "o-3", 1, "order.created"),
	}
	confirmed := make([]time.Time, len(msgs))
	before := time.Now()
	errs := p.PublishBatchTimed(ctx, msgs, confirmed)
	after := time.Now()
	if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], outbox.ErrUnroutable) {
		t.Fatalf("errors %v, want the unroutable one only", errs)
	}
	for i, at := range confirmed {
		if at.Before(before) || at.After(after) {
			t.Errorf("message %d: confirm seen at %v, want within the call (%v to %v)", i, at, before, after)
		}
	}

	// Nothing sent, nothing confirmed.
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	confirmed = make([]time.Time, 1)
	if errs := p.PublishBatchTimed(ctx, msgs[:1], confirmed); !errors.Is(errs[0], outbox.ErrNotSent) || !confirmed[0].IsZero() {
		t.Errorf("closed publisher: error %v, confirm time %v; want not sent and no time", errs[0], confirmed[0])
	}
	if host, _ := p.Node(); host != "" {
		t.Errorf("Node after Close = %q, want none", host)
	}
}

var _ interface {
	PublishBatchTimed(context.Context, []outbox.Envelope, []time.Time) []error
	Node() (string, int)
} = (*outboxamqp.Publisher)(nil)

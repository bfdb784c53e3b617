package outboxnats_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// A message the publisher cannot send holds back the rest of its run:
// sent, they would be stored before it. They are not sent (ErrNotSent, no
// attempt counted; the relay sends them after it), while other aggregates'
// go.
func TestRefusedEventHoldsBackItsRun(t *testing.T) {
	srv := startServer(t)
	prefix := randomName("runs")
	stream := newStream(t, jetStream(t, srv.ClientURL()), jetstream.StreamConfig{Subjects: []string{prefix + ".>"}})
	p := newPublisher(t, srv.ClientURL(), prefix)
	at := time.Date(2026, 12, 4, 18, 28, 51, 0, time.UTC)
	event := func(id int64, agg string, version int64) outbox.Envelope {
		return outbox.Envelope{ID: id, AggregateType: "order", AggregateID: agg, AggregateVersion: version,
			EventType: "order.amended", Payload: []byte(`{}`), Headers: map[string]string{}, CreatedAt: at, Attempt: 1}
	}
	refused := event(1, "o-1", 9)
	refused.Headers["note"] = "two\nlines" // the client would change it: refused
	behind, other := event(2, "o-1", 10), event(3, "o-2", 1)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	errs := p.PublishBatch(ctx, []outbox.Envelope{refused, behind, other})
	if errs[0] == nil || errors.Is(errs[0], outbox.ErrNotSent) {
		t.Errorf("the refused message: %v, want a failure of its own", errs[0])
	}
	if !errors.Is(errs[1], outbox.ErrNotSent) {
		t.Errorf("the next version of its aggregate: %v, want ErrNotSent", errs[1])
	}
	if errs[2] != nil {
		t.Fatalf("another aggregate's message: %v", errs[2])
	}
	msgs, err := stream.read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 1 || msgs[0].Header.Get(jetstream.MsgIDHeader) != other.MessageID() {
		ids := make([]string, len(msgs))
		for i, m := range msgs {
			ids[i] = m.Header.Get(jetstream.MsgIDHeader)
		}
		t.Fatalf("the stream holds %v; want only %s", ids, other.MessageID())
	}
}

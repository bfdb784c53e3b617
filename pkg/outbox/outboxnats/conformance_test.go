package outboxnats_test

import (
	"context"
	"os"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/publishertest"
)

// The Publisher passes the publisher conformance kit against a NATS server
// run by the test: each check with a subject prefix and a stream of its own
// for the stored messages, a stream that refuses every message for the
// refused ones (MaxMsgSize 1), no stream for the unroutable ones (no
// responders), publishing through a proxy. JetStream deduplicates by
// Nats-Msg-Id.
func TestPublisherConformance(t *testing.T) {
	srv := startServer(t)
	publishertest.Run(t, publishertest.Harness{
		New:          func(t *testing.T) publishertest.Target { return newConformanceTarget(t, srv.ClientURL()) },
		Unroutable:   true,
		Refuses:      true,
		Deduplicates: true,
	})
}

func newConformanceTarget(t *testing.T, url string) publishertest.Target {
	js := jetStream(t, url)
	prefix := randomName("kit")
	stored := newStream(t, js, jetstream.StreamConfig{Subjects: []string{prefix + "." + publishertest.EventStored}})
	newStream(t, js, jetstream.StreamConfig{Subjects: []string{prefix + "." + publishertest.EventRefused}, MaxMsgSize: 1})
	px := outboxtest.NewTCPProxy(t, url[len("nats://"):])
	p := newPublisher(t, "nats://"+px.Addr(), prefix)
	read := func(ctx context.Context) ([]publishertest.Message, error) {
		msgs, err := stored.read(ctx)
		if err != nil {
			return nil, err
		}
		out := make([]publishertest.Message, len(msgs))
		for i, m := range msgs {
			h := make(map[string]string, len(m.Header))
			for k := range m.Header {
				h[k] = m.Header.Get(k)
			}
			out[i] = publishertest.Message{ID: m.Header.Get(jetstream.MsgIDHeader), Headers: h, Body: m.Data}
		}
		return out, nil
	}
	var pub outbox.Publisher = p
	if os.Getenv(kitMutantEnv) == "duplicate" {
		pub = &failsDuplicates{Publisher: p, seen: map[string]bool{}}
	}
	return publishertest.Target{Publisher: pub, Close: p.Close, Stored: read, Link: px}
}

package outboxamqp_test

import (
	"context"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

func TestParseURLs(t *testing.T) {
	tests := []struct {
		in      string
		want    []string
		wantErr string
	}{
		{in: "amqp://guest:guest@127.0.0.1:5672/", want: []string{"amqp://guest:guest@127.0.0.1:5672/"}},
		{
			in:   "amqp://u:p@n1:5672/v, amqp://u:p@n2:5673/v ,amqps://u:p@n3/v",
			want: []string{"amqp://u:p@n1:5672/v", "amqp://u:p@n2:5673/v", "amqps://u:p@n3/v"},
		},
		// A comma in a password is percent-encoded, so it splits nothing.
		{in: "amqp://u:a%2Cb@n1/v", want: []string{"amqp://u:a%2Cb@n1/v"}},
		{in: "amqp://n1/,", wantErr: "empty address"},
		{in: ",amqp://n1/", wantErr: "empty address"},
		{in: "amqp://n1/,http://n2/", wantErr: "address 2"},
		{in: "", wantErr: "empty address"},
	}
	for _, tt := range tests {
		got, err := outboxamqp.ParseURLs(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("ParseURLs(%q) = %q, %v; want an error with %q", tt.in, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || strings.Join(got, " ") != strings.Join(tt.want, " ") {
			t.Errorf("ParseURLs(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
		p, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: tt.in, Exchange: "x"})
		if err != nil {
			t.Errorf("NewPublisher(%q): %v", tt.in, err)
			continue
		}
		if p.Nodes() != len(tt.want) {
			t.Errorf("NewPublisher(%q).Nodes() = %d, want %d", tt.in, p.Nodes(), len(tt.want))
		}
		_ = p.Close()
	}
	if _, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: "amqp://n1/,", Exchange: "x"}); err == nil {
		t.Error("NewPublisher accepted a URL list with an empty address")
	}
}

// deadURL is the test broker's URL on a port where nothing listens.
func deadURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	u, err := url.Parse(testAMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Host = addr
	return u.String()
}

// With the first node down, the publisher connects to the second and a
// message counts as published only on that node's confirm.
func TestPublisherFailsOverToTheNextAddress(t *testing.T) {
	t.Parallel()
	b := newBroker(t, true)
	dead := deadURL(t)
	p := newPublisher(t, dead+","+testAMQPURL(), b.Exchange, testLogger(t, nil))
	for i, err := range publishBatch(t, p, envelope(1, "o-1", 1, "order.created")) {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	b.WaitDeliveries("the message", 10*time.Second, func(ds []amqp.Delivery) bool { return receivedIDs(ds)[1] == 1 })

	// Every node down: WaitReady names each failed node.
	p2 := newPublisher(t, dead+","+dead, b.Exchange, testLogger(t, nil))
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	if err := p2.WaitReady(ctx); err == nil {
		t.Fatal("WaitReady connected with every node down")
	}
	if err := p2.Ready(); err == nil || strings.Count(err.Error(), "127.0.0.1:") < 2 {
		t.Errorf("Ready = %v; want both failed nodes named", err)
	}
}

// A lost connection moves the publisher to another node, though the first
// one accepts connections again by then.
func TestPublisherMovesToAnotherNodeOnALostConnection(t *testing.T) {
	t.Parallel()
	b := newBroker(t, true)
	first, second := newProxy(t), newProxy(t)
	p := newPublisher(t, first.URL(t)+","+second.URL(t), b.Exchange, testLogger(t, nil))
	if errs := publishBatch(t, p, envelope(1, "o-1", 1, "order.created")); errs[0] != nil {
		t.Fatal(errs[0])
	}
	if n := first.Connections(); n != 1 {
		t.Fatalf("%d connections through the first node, want 1", n)
	}
	first.Stop() // cuts the connection
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the lost connection noticed", func() bool { return p.Ready() != nil })
	if errs := publishBatch(t, p, envelope(2, "o-1", 2, "order.cancelled")); errs[0] != nil {
		t.Fatal(errs[0])
	}
	if n := second.Connections(); n != 1 {
		t.Errorf("%d connections through the second node after the loss, want 1", n)
	}
	b.WaitDeliveries("both messages", 10*time.Second, func(ds []amqp.Delivery) bool {
		ids := receivedIDs(ds)
		return ids[1] == 1 && ids[2] == 1
	})
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A nack ends the batch's channel, not the connection: the next publish goes
// on a new channel of the same connection (a quorum queue's channel that saw
// a nack during a leader election kept nacking on RabbitMQ 3.10), and other
// batches' channels are left alone. Here a full queue with reject-publish
// nacks.
func TestPublisherClosesTheChannelOfANack(t *testing.T) {
	t.Parallel()
	b := newBroker(t, false)
	b.bind("order.*", amqp.Table{"x-max-length": int64(1), "x-overflow": "reject-publish"})
	proxy := newProxy(t)
	p := newPublisher(t, proxy.URL(t), b.Exchange, testLogger(t, nil))
	errs := publishBatch(t, p, envelope(1, "o-1", 1, "order.created"), envelope(2, "o-1", 2, "order.cancelled"))
	if errs[0] != nil || errs[1] == nil || !strings.Contains(errs[1].Error(), "nacked") {
		t.Fatalf("results %v; want the first confirmed and the second nacked", errs)
	}
	if _, err := b.Ch.QueuePurge(b.Queue, false); err != nil {
		t.Fatal(err)
	}
	if errs := publishBatch(t, p, envelope(3, "o-2", 1, "order.created")); errs[0] != nil {
		t.Fatalf("after the nack: %v, want a confirm on a new channel", errs[0])
	}
	if err := p.Ready(); err != nil {
		t.Fatalf("Ready after the nack: %v", err)
	}
	if n := proxy.Connections(); n != 1 {
		t.Errorf("%d connections, want the first one still", n)
	}
}

package rabbitmq

import (
	"errors"
	"log/slog"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
)

// A nack drops the republisher's connection: the next copy goes on a new one
// (a quorum queue's channel that saw a nack during a leader election kept
// nacking on RabbitMQ 3.10). A full queue with reject-publish nacks here.
func TestRepublisherDialsAnewAfterANack(t *testing.T) {
	_, url := amqptest.VHost(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	const queue = "full"
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-max-length": int64(1), "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	nodes, err := amqpaddr.New(url)
	if err != nil {
		t.Fatal(err)
	}
	r := &republisher{nodes: nodes, name: "nack-test", inFlight: 4, log: slog.New(slog.DiscardHandler)}
	defer r.close()
	if err := r.publish(t.Context(), "", queue, amqp.Publishing{Body: []byte("1")}); err != nil {
		t.Fatalf("first copy: %v", err)
	}
	r.mu.Lock()
	first := r.pub
	r.mu.Unlock()
	if err := r.publish(t.Context(), "", queue, amqp.Publishing{Body: []byte("2")}); !errors.Is(err, errNacked) {
		t.Fatalf("second copy into the full queue: %v, want a nack", err)
	}
	r.mu.Lock()
	after := r.pub
	r.mu.Unlock()
	if after != nil || !first.closed() {
		t.Fatalf("after the nack the publisher is %p (was %p, closed=%v); want it dropped and closed", after, first, first.closed())
	}
	if _, err := ch.QueuePurge(queue, false); err != nil {
		t.Fatal(err)
	}
	if err := r.publish(t.Context(), "", queue, amqp.Publishing{Body: []byte("3")}); err != nil {
		t.Fatalf("copy after the nack: %v", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pub == nil || r.pub == first {
		t.Error("the copy after the nack did not go on a new connection")
	}
}

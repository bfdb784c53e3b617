package e2e

import (
	"regexp"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// TestDelayQueueHeadReadsTheQueuesState checks the drain's probe of the
// delay queue on the machine's broker: a message waiting out a 60 s TTL is
// reported ready, with its head to expire in about a minute.
func TestDelayQueueHeadReadsTheQueuesState(t *testing.T) {
	if testing.Short() {
		t.Skip("needs RabbitMQ")
	}
	requireServices(t, true)
	vhost := "delayhead_" + time.Now().Format("150405.000")
	url := tempVhost(t, vhost, "")
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(delayQueue, true, false, false, false, amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int64(60_000)}); err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), "", delayQueue, true, false, amqp.Publishing{Body: []byte("x")})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := dc.WaitContext(t.Context()); !ok || err != nil {
		t.Fatalf("publish not confirmed: %v", err)
	}
	c := &cluster{t: t, vhost: vhost}
	got := c.delayQueueHead(t.Context())
	m := regexp.MustCompile(`^delay queue: 1 ready, its head expires in (\d+\.\d)s$`).FindStringSubmatch(got)
	var in float64
	if m != nil {
		in, _ = strconv.ParseFloat(m[1], 64)
	}
	if m == nil || in < 50 || in > 60 {
		t.Fatalf("delayQueueHead = %q; want 1 ready, the head to expire in 50 to 60 s", got)
	}
}

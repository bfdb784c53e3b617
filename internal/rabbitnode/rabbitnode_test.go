package rabbitnode_test

import (
	"os"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/internal/rabbitnode"
)

func TestANodeOfItsOwnServesAMQPUntilClosed(t *testing.T) {
	n := rabbitnode.ForTest(t, "rabbitnode-test")
	if n.Port == "5672" {
		t.Fatalf("the node listens on %s, the machine's broker's port", n.Port)
	}
	conn, err := amqp.Dial(n.URL())
	if err != nil {
		t.Fatalf("dial %s: %v", n.URL(), err)
	}
	_ = conn.Close()
	if out, err := n.Ctl(t.Context(), "status"); err != nil {
		t.Fatalf("rabbitmqctl status: %v", err)
	} else if len(out) == 0 {
		t.Fatal("rabbitmqctl status said nothing")
	}
	// advanced.config applied: the dead-letter worker's retry (RabbitAppEnv).
	if out, err := n.Ctl(t.Context(), "eval", "application:get_env(rabbit, dead_letter_worker_publisher_confirm_timeout)."); err != nil {
		t.Fatalf("rabbitmqctl eval: %v", err)
	} else if !strings.Contains(out, "{ok,10000}") {
		t.Errorf("dead_letter_worker_publisher_confirm_timeout: %q, want {ok,10000}", out)
	}
	if err := n.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := os.Stat(n.Dir); !os.IsNotExist(err) {
		t.Fatalf("node directory %s still there after Close: %v", n.Dir, err)
	}
	if _, err := amqp.Dial(n.URL()); err == nil {
		t.Fatal("the node still serves after Close")
	}
}

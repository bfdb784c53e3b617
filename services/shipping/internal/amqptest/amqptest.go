// Package amqptest gives the shipping tests a RabbitMQ vhost of their own,
// created with rabbitmqctl on the local broker and deleted at the end, and
// helpers to cut its connections and count its queues.
//
// The broker is TEST_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/).
// Without a reachable broker and rabbitmqctl, tests skip, or fail under
// CI=true.
package amqptest

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// BaseURL is the broker the tests use.
func BaseURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("amqptest: "+format+" (required under CI=true)", args...)
	}
	t.Skipf("amqptest: "+format, args...)
}

func ctl(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "rabbitmqctl", append([]string{"-q"}, args...)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, out.String())
	}
	return out.String(), nil
}

// VHost creates a fresh vhost and returns its name and an AMQP URL for it.
// The vhost is deleted when the test ends.
func VHost(t testing.TB) (name, amqpURL string) {
	t.Helper()
	u, err := url.Parse(BaseURL())
	if err != nil {
		t.Fatalf("amqptest: TEST_AMQP_URL: %v", err)
	}
	conn, err := amqp.Dial(BaseURL())
	if err != nil {
		unavailable(t, "RabbitMQ unreachable at %s: %v (set TEST_AMQP_URL)", BaseURL(), err)
	}
	_ = conn.Close()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		unavailable(t, "rabbitmqctl not found: %v", err)
	}

	b := make([]byte, 5)
	_, _ = rand.Read(b)
	name = "shipping-test-" + hex.EncodeToString(b)
	user := u.User.Username()
	if _, err := ctl(t.Context(), "add_vhost", name); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	t.Cleanup(func() {
		if _, err := ctl(context.WithoutCancel(t.Context()), "delete_vhost", name); err != nil {
			t.Errorf("amqptest: %v", err)
		}
	})
	if _, err := ctl(t.Context(), "set_permissions", "-p", name, user, ".*", ".*", ".*"); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	u.Path = "/" + name
	return name, u.String()
}

// CloseConnections cuts every client connection of vhost, as a broker restart
// would (without stopping the broker others use).
func CloseConnections(t testing.TB, vhost string) {
	t.Helper()
	if _, err := ctl(t.Context(), "close_all_connections", "--vhost", vhost, "amqptest: simulated broker restart"); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
}

// TryCloseConnections is CloseConnections for goroutines other than the
// test's: it returns the error.
func TryCloseConnections(ctx context.Context, vhost string) error {
	_, err := ctl(ctx, "close_all_connections", "--vhost", vhost, "amqptest: simulated crash")
	return err
}

// QueueCounts returns the ready and unacknowledged message counts of queue.
func QueueCounts(t testing.TB, vhost, queue string) (ready, unacked int) {
	t.Helper()
	out, err := ctl(t.Context(), "list_queues", "-p", vhost, "--no-table-headers", "name", "messages_ready", "messages_unacknowledged")
	if err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == queue {
			r, _ := strconv.Atoi(f[1])
			u, _ := strconv.Atoi(f[2])
			return r, u
		}
	}
	t.Fatalf("amqptest: queue %s not found in vhost %s: %q", queue, vhost, out)
	return 0, 0
}

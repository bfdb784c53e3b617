// Package amqptest gives the shipping tests a RabbitMQ vhost of their own,
// created with rabbitmqctl on the local broker and deleted at the end, and
// helpers to cut its connections, list them by name, revoke and restore the
// test user's access, delete queues and count their messages, all from the
// broker's side.
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
	"regexp"
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

// Queue makes a vhost of the test's own (VHost) with a queue named queue,
// and returns its URL and a channel on it, closed when the test ends.
func Queue(t testing.TB, queue string) (amqpURL string, ch *amqp.Channel) {
	t.Helper()
	_, amqpURL = VHost(t)
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if ch, err = conn.Channel(); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	return amqpURL, ch
}

// GetOne waits up to 30 seconds for a message in queue, takes it with
// basic.get and returns it; it fails the test if none comes.
func GetOne(t testing.TB, ch *amqp.Channel, queue string) amqp.Delivery {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("no message in %s within 30s", queue)
		}
		time.Sleep(20 * time.Millisecond)
	}
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
	ready, unacked, ok := TryQueueCounts(t, vhost, queue)
	if !ok {
		t.Fatalf("amqptest: queue %s not found in vhost %s", queue, vhost)
	}
	return ready, unacked
}

// TryQueueCounts is QueueCounts for a queue that may not exist: ok is false
// when it does not.
func TryQueueCounts(t testing.TB, vhost, queue string) (ready, unacked int, ok bool) {
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
			return r, u, true
		}
	}
	return 0, 0, false
}

// DeleteQueue deletes queue from the broker's side, as an operator would;
// its consumers get a basic.cancel.
func DeleteQueue(t testing.TB, vhost, queue string) {
	t.Helper()
	if _, err := ctl(t.Context(), "delete_queue", "-p", vhost, queue); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
}

// RevokeAccess clears the test user's permissions on vhost: open
// connections keep working, new ones are refused (NOT_ALLOWED), so a client
// that lost its connection cannot come back until RestoreAccess.
func RevokeAccess(t testing.TB, vhost string) {
	t.Helper()
	u, err := url.Parse(BaseURL())
	if err != nil {
		t.Fatalf("amqptest: TEST_AMQP_URL: %v", err)
	}
	if _, err := ctl(t.Context(), "clear_permissions", "-p", vhost, u.User.Username()); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
}

// RestoreAccess gives the test user back full permissions on vhost.
func RestoreAccess(t testing.TB, vhost string) {
	t.Helper()
	u, err := url.Parse(BaseURL())
	if err != nil {
		t.Fatalf("amqptest: TEST_AMQP_URL: %v", err)
	}
	if _, err := ctl(t.Context(), "set_permissions", "-p", vhost, u.User.Username(), ".*", ".*", ".*"); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
}

// Connection is one client connection to a vhost.
type Connection struct {
	// PID is the broker's id of the connection, for CloseConnection.
	PID string
	// Name is the client-provided connection name ("" when none).
	Name string
}

var connectionName = regexp.MustCompile(`\{"connection_name","([^"]*)"\}`)

// Connections lists the client connections of vhost.
func Connections(t testing.TB, vhost string) []Connection {
	t.Helper()
	out, err := ctl(t.Context(), "list_connections", "--no-table-headers", "pid", "vhost", "client_properties")
	if err != nil {
		t.Fatalf("amqptest: %v", err)
	}
	var conns []Connection
	for _, line := range strings.Split(out, "\n") {
		f := strings.SplitN(line, "\t", 3)
		if len(f) != 3 || f[1] != vhost {
			continue
		}
		c := Connection{PID: f[0]}
		if m := connectionName.FindStringSubmatch(f[2]); m != nil {
			c.Name = m[1]
		}
		conns = append(conns, c)
	}
	return conns
}

// CloseConnection closes one connection (a PID from Connections) from the
// broker's side.
func CloseConnection(t testing.TB, pid, reason string) {
	t.Helper()
	if _, err := ctl(t.Context(), "close_connection", pid, reason); err != nil {
		t.Fatalf("amqptest: %v", err)
	}
}

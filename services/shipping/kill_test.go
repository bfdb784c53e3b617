package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
)

// subprocessEnv, when set, makes this test binary the shipping service: the
// tests below run it as a process of its own, to kill it for real.
const subprocessEnv = "SHIPPING_TEST_SUBPROCESS"

func TestShippingSubprocess(t *testing.T) {
	if os.Getenv(subprocessEnv) == "" {
		t.Skip("only run as the service's subprocess")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, nil, os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "shipping:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// service is a shipping process started from this test binary.
type service struct {
	cmd  *exec.Cmd
	addr string
	done chan error
	logs *strings.Builder
}

func startService(t *testing.T, env map[string]string) *service {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestShippingSubprocess$", "-test.count=1")
	cmd.Env = append(os.Environ(), subprocessEnv+"=1", "HTTP_ADDR=127.0.0.1:0", "LOG_LEVEL=debug")
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &service{cmd: cmd, done: make(chan error, 1), logs: &strings.Builder{}}
	addr := make(chan string, 1)
	go func() {
		lines := bufio.NewScanner(out)
		for lines.Scan() {
			s.logs.WriteString(lines.Text() + "\n") // read only after done
			var rec struct {
				Msg      string `json:"msg"`
				HTTPAddr string `json:"http_addr"`
			}
			if json.Unmarshal(lines.Bytes(), &rec) == nil && rec.Msg == "listening" {
				addr <- rec.HTTPAddr
			}
		}
		s.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-s.done
		}
		if t.Failed() {
			t.Logf("service logs:\n%s", s.logs.String())
		}
	})
	select {
	case s.addr = <-addr:
	case err := <-s.done:
		t.Fatalf("service exited before listening: %v\n%s", err, s.logs.String())
	case <-time.After(60 * time.Second):
		t.Fatal("service did not listen within 60s")
	}
	waitUntil(t, 60*time.Second, "service ready", func() bool {
		resp, err := http.Get("http://" + s.addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return s
}

// metric returns the value of the sample whose line starts with name.
func (s *service) metric(t *testing.T, name string) string {
	t.Helper()
	resp, err := http.Get("http://" + s.addr + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+" "); ok {
			return v
		}
	}
	return ""
}

func waitUntil(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func publishCreated(t *testing.T, amqpURL, msgID, orderID string) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	body := fmt.Sprintf(`{"order_id":%q,"customer_id":"c-42","currency":"EUR","items":[],"total":0,"created_at":"2026-11-29T22:00:00Z"}`, orderID)
	dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), "orders.events", "order.created", true, false, amqp.Publishing{
		MessageId: msgID, Type: "order.created", ContentType: "application/json", DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"aggregate_type": "order", "aggregate_id": orderID, "event_type": "order.created", "aggregate_version": int64(1)},
		Body:    []byte(body),
	})
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := dc.WaitContext(t.Context()); !ok || err != nil {
		t.Fatalf("publish not confirmed: %v", err)
	}
}

// The crash between the inbox record and the ack, for real: the service runs
// as a process with buffered inbox records (INBOX_FLUSH_INTERVAL) and the
// crash point armed; it is SIGKILLed after the effect and after the record
// was buffered, before the flush and before the ack. The record is lost with
// the process; the restarted service gets the redelivery, finds no record,
// reruns the handler, and the store recognises the version: one effect.
func TestKilledInTheFlushWindowTheRedeliveryDoesNotDoubleTheEffect(t *testing.T) {
	vhost, amqpURL := amqptest.VHost(t)
	uri, dbName := mongotest.ForTest(t)
	env := map[string]string{"AMQP_URL": amqpURL, "MONGO_URI": uri + dbName, "INBOX_FLUSH_INTERVAL": "1h"}

	crashing := startService(t, map[string]string{
		"AMQP_URL": amqpURL, "MONGO_URI": uri + dbName, "INBOX_FLUSH_INTERVAL": "1h",
		"CRASH_POINT": crashpoint.ShippingAfterInboxBeforeAck,
	})
	publishCreated(t, amqpURL, "901", "order-9")
	select {
	case err := <-crashing.done:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("service ended with %v, want killed by SIGKILL at %s", err, crashpoint.ShippingAfterInboxBeforeAck)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the crash point did not fire within 60s")
	}

	client, err := mongo.Connect(options.Client().ApplyURI(uri))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Disconnect(context.WithoutCancel(t.Context()))
	db := client.Database(dbName)
	store, _ := mongodb.New(db, "")
	in, err := inbox.New(db, inbox.Config{Consumer: "shipping", DoneCacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	// Killed inside the flush window: the effect is there, its record is not.
	if s, err := store.Get(t.Context(), "order-9"); err != nil || len(s.Events) != 1 {
		t.Fatalf("after the kill: shipment %+v, %v; want the effect applied", s, err)
	}
	if done, err := in.IsDone(t.Context(), "901"); err != nil || done {
		t.Fatalf("after the kill: inbox record done=%v, %v; want none (it was only buffered)", done, err)
	}

	env["INBOX_FLUSH_INTERVAL"] = "10ms"
	restarted := startService(t, env)
	waitUntil(t, 60*time.Second, "the redelivery handled", func() bool {
		return restarted.metric(t, `shipping_events_duplicate_total{layer="version"}`) == "1"
	})
	if p := restarted.metric(t, "shipping_events_processed_total"); p != "0" {
		t.Errorf("processed %s after the restart, want 0: the redelivery is no new effect", p)
	}
	waitUntil(t, 30*time.Second, "the inbox record written", func() bool {
		done, err := in.IsDone(t.Context(), "901")
		return err == nil && done
	})
	s, err := store.Get(t.Context(), "order-9")
	if err != nil || len(s.Events) != 1 || s.Events[0].MessageID != "901" {
		t.Fatalf("shipment %+v, %v; want the one effect of 901", s, err)
	}
	n, err := db.Collection(mongodb.DefaultCollection).CountDocuments(t.Context(), map[string]any{"order_id": "order-9"})
	if err != nil || n != 1 {
		t.Fatalf("%d effect documents for order-9 (%v), want 1", n, err)
	}
	if ready, unacked := amqptest.QueueCounts(t, vhost, "shipping.order-events"); ready+unacked != 0 {
		t.Fatalf("queue holds %d ready, %d unacked; want the redelivery acked", ready, unacked)
	}
	if ready, _ := amqptest.QueueCounts(t, vhost, "shipping.order-events.dlq"); ready != 0 {
		t.Fatalf("%d dead letters, want none", ready)
	}

	_ = restarted.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-restarted.done:
		if err != nil {
			t.Errorf("restarted service on SIGTERM: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Error("restarted service did not stop within 60s of SIGTERM")
	}
}

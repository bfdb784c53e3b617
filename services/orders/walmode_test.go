package main

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
)

// With RELAY_MODE=wal the service's relay reads the outbox from the
// write-ahead log: an order and its cancel reach RabbitMQ in order, their
// rows leave the outbox, and /metrics shows the slot's lag and the relay's
// state.
func TestServeWithTheWALRelay(t *testing.T) {
	t.Parallel()
	testServeWithTheWALRelay(t, config.EnvelopeOutbox)
}

// The same relay publishes the CloudEvents envelope with
// RELAY_ENVELOPE=cloudevents.
func TestServeWithTheWALRelayInTheCloudEventsEnvelope(t *testing.T) {
	t.Parallel()
	testServeWithTheWALRelay(t, config.EnvelopeCloudEvents)
}

func testServeWithTheWALRelay(t *testing.T, envelope string) {
	dbURL := migratedDatabaseURL(t)
	pool := connectPool(t, dbURL)
	var level string
	if err := pool.QueryRow(t.Context(), "SHOW wal_level").Scan(&level); err != nil {
		t.Fatal(err)
	}
	if level != "logical" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("wal_level=%s: RELAY_MODE=wal needs logical (deploy/local/ensure-services.sh sets it)", level)
		}
		t.Skipf("wal_level=%s: RELAY_MODE=wal needs logical", level)
	}
	slot := "orders_test_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	t.Cleanup(func() { // after the process stopped: registered before it
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for {
			err := outboxwal.Drop(ctx, pool, slot, slot)
			if err == nil {
				return
			}
			if ctx.Err() != nil {
				t.Errorf("drop slot: %v", err)
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	amqpURL := newVhost(t)
	deliveries := bindQueue(t, amqpURL)
	addr := freeAddr(t)
	start(t, map[string]string{
		"DATABASE_URL": dbURL, "AMQP_URL": amqpURL, "HTTP_ADDR": addr,
		"RELAY_MODE": "wal", "RELAY_WAL_SLOT": slot, "RELAY_ENVELOPE": envelope,
	})
	base := "http://" + addr
	waitReady(t, base)
	waitMetrics(t, base, "\noutbox_wal_relay_active 1\n")

	status, o := post(t, base+"/orders", orderBody)
	if status != 201 {
		t.Fatalf("create: %d %v", status, o)
	}
	id := o["id"].(string)
	if status, _ := post(t, base+"/orders/"+id+"/cancel", ""); status != 200 {
		t.Fatalf("cancel: %d", status)
	}
	for i, want := range []string{"order.created", "order.cancelled"} {
		m := receive(t, deliveries)
		order, typ := m.Headers["aggregate_id"], m.Headers["event_type"]
		if envelope == config.EnvelopeCloudEvents {
			order, typ = m.Headers["cloudEvents_subject"], m.Headers["cloudEvents_type"]
		}
		if m.RoutingKey != want || typ != want || order != id {
			t.Fatalf("message %d: %s (type %v) for %v, want %s of %s", i, m.RoutingKey, typ, order, want, id)
		}
	}
	waitMetrics(t, base, "\noutbox_published_total 2\n", "\noutbox_pending 0\n", "outbox_wal_slot_lag_bytes ", "\noutbox_wal_slot_up 1\n")
	// As with the polling relay, published events are kept for audit.
	var archived int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM outbox_published WHERE aggregate_id = $1", id).Scan(&archived); err != nil {
		t.Fatal(err)
	}
	if archived != 2 {
		t.Fatalf("outbox_published holds %d events of the order, want 2", archived)
	}
}

func TestRelayModeSetting(t *testing.T) {
	for env, wantErr := range map[string]bool{"": false, "poll": false, "wal": false, "WAL": false, "kafka": true} {
		_, err := config.FromEnv(func(k string) string {
			if k == "RELAY_MODE" {
				return env
			}
			return ""
		})
		if (err != nil) != wantErr {
			t.Errorf("RELAY_MODE=%q: error %v, want error %v", env, err, wantErr)
		}
	}
	_, err := config.FromEnv(func(k string) string {
		return map[string]string{"RELAY_MODE": "wal", "DATABASE_POOLER": "transaction"}[k]
	})
	if err == nil {
		t.Error("RELAY_MODE=wal behind DATABASE_POOLER=transaction: no error")
	}
}

package main

import (
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/config"
)

// RELAY_ENVELOPE=cloudevents: the relay publishes each order event as a
// CloudEvents 1.0 event in the AMQP binding's binary content mode (the
// full mapping is tested in outboxamqp): its id the message id, its source
// RELAY_CLOUDEVENTS_SOURCE, its subject the order, its aggregateversion the
// event's version; the outbox envelope's headers are gone.
func TestServePublishesCloudEventsWithRelayEnvelope(t *testing.T) {
	t.Parallel()
	amqpURL := newVhost(t)
	deliveries := bindQueue(t, amqpURL)
	addr := freeAddr(t)
	start(t, map[string]string{
		"DATABASE_URL": migratedDatabaseURL(t), "AMQP_URL": amqpURL, "HTTP_ADDR": addr,
		"RELAY_ENVELOPE": "cloudevents", "RELAY_CLOUDEVENTS_SOURCE": "urn:example:orders",
	})
	base := "http://" + addr
	waitReady(t, base)
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
		h := m.Headers
		if _, _, err := outbox.ParseMessageID(m.MessageId); err != nil || h["cloudEvents_id"] != m.MessageId {
			t.Errorf("message %d: id %v, MessageId %q", i, h["cloudEvents_id"], m.MessageId)
		}
		if h["cloudEvents_specversion"] != "1.0" || h["cloudEvents_source"] != "urn:example:orders" || h["cloudEvents_type"] != want ||
			h["cloudEvents_subject"] != id || h["cloudEvents_aggregatetype"] != "order" || h["cloudEvents_aggregateversion"] != int64(i+1) {
			t.Errorf("message %d: attributes %v", i, h)
		}
		if s, _ := h["cloudEvents_time"].(string); func() error { _, err := time.Parse(time.RFC3339Nano, s); return err }() != nil {
			t.Errorf("message %d: time %v", i, h["cloudEvents_time"])
		}
		for _, k := range []string{"aggregate_type", "aggregate_id", "event_type", "aggregate_version", "outbox_created_at"} {
			if v, ok := h[k]; ok {
				t.Errorf("message %d: outbox envelope header %s = %v", i, k, v)
			}
		}
	}
}

func TestRelayEnvelopeSetting(t *testing.T) {
	for env, want := range map[string]string{"": config.EnvelopeOutbox, "outbox": config.EnvelopeOutbox, "CloudEvents": config.EnvelopeCloudEvents} {
		cfg, err := config.FromEnv(func(k string) string { return map[string]string{"RELAY_ENVELOPE": env}[k] })
		if err != nil || cfg.Envelope != want {
			t.Errorf("RELAY_ENVELOPE=%q: %q (%v), want %q", env, cfg.Envelope, err, want)
		}
		if (cfg.CloudEvents() != nil) != (want == config.EnvelopeCloudEvents) {
			t.Errorf("RELAY_ENVELOPE=%q: CloudEvents() = %v", env, cfg.CloudEvents())
		}
	}
	cfg, err := config.FromEnv(func(k string) string { return map[string]string{"RELAY_ENVELOPE": "cloudevents"}[k] })
	if err != nil || cfg.CloudEvents().Source != "/orders" {
		t.Errorf("default source: %+v, %v", cfg.CloudEvents(), err)
	}
	for name, env := range map[string]map[string]string{
		"unknown envelope": {"RELAY_ENVELOPE": "avro"},
		"bad source":       {"RELAY_ENVELOPE": "cloudevents", "RELAY_CLOUDEVENTS_SOURCE": "/%zz"},
	} {
		if _, err := config.FromEnv(func(k string) string { return env[k] }); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

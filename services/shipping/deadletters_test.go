package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/amqptest"
	"github.com/outbox-inbox/reference/services/shipping/internal/deadletter"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

func TestDeadLettersCLIListsAndDiscards(t *testing.T) {
	vhost, amqpURL := amqptest.VHost(t)
	db := mongotest.Database(t)
	uri := mongotest.URI(t) + db.Name()
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare("cli-q", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}

	store, _ := deadletter.NewStore(db)
	now := time.Now().UTC()
	msg := func(id string) shipment.KeptMessage {
		return shipment.KeptMessage{MessageID: id, Type: "order.cancelled", RoutingKey: "order.cancelled",
			Headers: map[string]any{"aggregate_id": "o-1", "aggregate_version": int64(3)}, Body: []byte(`{"order_id":"o-1"}`)}
	}
	if err := store.Record(t.Context(), shipment.Letter{OrderID: "o-1", Version: 2, EventType: "order.paid",
		Reason: "malformed_payload", Error: "bad json", Holds: true, DeadLetteredAt: now, Message: msg("m2")}); err != nil {
		t.Fatal(err)
	}
	if err := store.Park(t.Context(), shipment.Parked{OrderID: "o-1", Version: 3, ParkedAt: now, Message: msg("m3")}); err != nil {
		t.Fatal(err)
	}
	vars := env(map[string]string{"MONGO_URI": uri, "AMQP_URL": amqpURL})

	var out bytes.Buffer
	if err := run(t.Context(), []string{"dead-letters", "list"}, vars, &out); err != nil {
		t.Fatalf("list: %v", err)
	}
	for _, want := range []string{"malformed_payload", "m2", "bad json", "HELD ORDER", "held"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("list output lacks %q:\n%s", want, out.String())
		}
	}

	out.Reset()
	if err := run(t.Context(), []string{"dead-letters", "discard", "-queue", "cli-q", "o-1", "2"}, vars, &out); err != nil {
		t.Fatalf("discard: %v", err)
	}
	if !strings.Contains(out.String(), "discarded o-1 version 2; released 1 parked messages") {
		t.Fatalf("discard output: %s", out.String())
	}
	if ready, _ := amqptest.QueueCounts(t, vhost, "cli-q"); ready != 1 {
		t.Fatalf("%d messages released to the queue, want the parked one", ready)
	}
	var rec struct {
		Discarded bool   `bson:"discarded"`
		MessageID string `bson:"message_id"`
	}
	if err := db.Collection(mongodb.DefaultCollection).FindOne(t.Context(), map[string]any{"_id": "o-1/2"}).Decode(&rec); err != nil || !rec.Discarded || rec.MessageID != "m2" {
		t.Fatalf("skipped version: %+v, %v", rec, err)
	}

	for name, args := range map[string][]string{
		"no subcommand":   {"dead-letters"},
		"unknown":         {"dead-letters", "retry"},
		"no version":      {"dead-letters", "replay", "o-1"},
		"bad version":     {"dead-letters", "replay", "o-1", "two"},
		"list with args":  {"dead-letters", "list", "x"},
		"no such letter":  {"dead-letters", "replay", "-queue", "cli-q", "o-1", "9"},
		"discarded again": {"dead-letters", "discard", "-queue", "cli-q", "o-1", "2"},
	} {
		if err := run(t.Context(), args, vars, &out); err == nil {
			t.Errorf("%s: %v succeeded, want an error", name, args)
		}
	}
}

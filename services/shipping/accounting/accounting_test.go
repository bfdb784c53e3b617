package accounting_test

import (
	"maps"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
	"github.com/outbox-inbox/reference/services/shipping/accounting"
	"github.com/outbox-inbox/reference/services/shipping/internal/deadletter"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(mongotest.Suite(m)) }

// Each way shipping keeps a message, or its effect, without an inbox record
// is told apart; a version held by another message, or by nothing, is not
// accounted for.
func TestAccountTellsWhatShippingDidWithAMessage(t *testing.T) {
	t.Parallel()
	db := mongotest.Database(t)
	ctx := t.Context()
	shipments, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	letters, err := deadletter.NewStore(db)
	if err != nil {
		t.Fatal(err)
	}
	created := func(orderID string) shipment.Event {
		return shipment.Event{Type: shipment.TypeCreated, OrderID: orderID, Version: 1,
			Created: &shipment.Created{OrderID: orderID, CustomerID: "c", Currency: "EUR", Total: 1}}
	}
	at := time.Now().Add(-time.Hour)
	id := func(n int64) string { return outbox.MessageID(n, at) }
	for msgID, ev := range map[string]shipment.Event{id(1): created("o-1"), id(5): created("o-3")} {
		if _, err := shipments.Apply(ctx, msgID, ev); err != nil {
			t.Fatal(err)
		}
	}
	if err := shipments.Skip(ctx, "o-1", 2, id(2), shipment.TypeCancelled); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	if err := letters.Record(ctx, shipment.Letter{OrderID: "o-2", Version: 1, Reason: "handler_failed", Holds: true,
		DeadLetteredAt: now, Message: shipment.KeptMessage{MessageID: id(3)}}); err != nil {
		t.Fatal(err)
	}
	if err := letters.Park(ctx, shipment.Parked{OrderID: "o-2", Version: 2, ParkedAt: now,
		Message: shipment.KeptMessage{MessageID: id(4)}}); err != nil {
		t.Fatal(err)
	}

	books, err := accounting.New(db)
	if err != nil {
		t.Fatal(err)
	}
	got, err := books.Account(ctx, []outboxaudit.LoggedEvent{
		{ID: 1, AggregateID: "o-1", AggregateVersion: 1, CreatedAt: at},
		{ID: 2, AggregateID: "o-1", AggregateVersion: 2, CreatedAt: at},
		{ID: 3, AggregateID: "o-2", AggregateVersion: 1, CreatedAt: at},
		{ID: 4, AggregateID: "o-2", AggregateVersion: 2, CreatedAt: at},
		{ID: 6, AggregateID: "o-3", AggregateVersion: 1, CreatedAt: at}, // version 1 of o-3 is message 5
		{ID: 7, AggregateID: "o-4", AggregateVersion: 1, CreatedAt: at}, // nothing there
		{ID: 8, AggregateID: "o-2", AggregateVersion: 3, CreatedAt: at},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := map[int64]audit.Kept{1: audit.KeptEffect, 2: audit.KeptHeld, 3: audit.KeptHeld, 4: audit.KeptHeld}
	if !maps.Equal(got, want) {
		t.Fatalf("Account = %v, want %v", got, want)
	}
	if got, err := books.Account(ctx, nil); err != nil || len(got) != 0 {
		t.Fatalf("Account(nil) = %v, %v", got, err)
	}
	if _, err := books.Account(ctx, make([]outboxaudit.LoggedEvent, accounting.MaxEvents+1)); err == nil {
		t.Fatal("Account of too many messages: want an error")
	}
}

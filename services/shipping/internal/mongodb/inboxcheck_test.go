package mongodb_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/internal/mongolocal/replsettest"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/inboxcheck"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// shippingSubject is shipping's handler as the processor runs it through
// the inbox's version gate (Store.Apply with the context the inbox gives),
// on order events:
// version 1 order.created, later versions order.cancelled. Its effect is the
// shipment's list of applied events, each with when it was applied.
func shippingSubject(t *testing.T, db *mongo.Database, cfg inbox.Config) inboxcheck.Subject {
	t.Helper()
	s, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	return inboxcheck.Subject{
		Inbox: cfg,
		Gate:  func(in *inbox.Inbox) (inboxcheck.Gate, error) { return inbox.NewGate(in, inbox.GateConfig{}) },
		Handler: func(m inboxcheck.Message) inbox.Handler {
			ev := shipment.Event{OrderID: m.AggregateID, Version: m.Version,
				Type: shipment.TypeCancelled, Cancelled: &shipment.Cancelled{OrderID: m.AggregateID}}
			if m.Version == 1 {
				ev.Type, ev.Cancelled = shipment.TypeCreated, nil
				ev.Created = &shipment.Created{OrderID: m.AggregateID, CustomerID: "c-1", Currency: "EUR", Total: 100}
			}
			return func(ctx context.Context) error {
				_, err := s.Apply(ctx, m.ID, ev)
				return err
			}
		},
		Applied: func(ctx context.Context, orderID string) ([]string, error) {
			sh, err := s.Get(ctx, orderID)
			if errors.Is(err, shipment.ErrNotFound) {
				return nil, nil
			}
			// In the order they were applied (the shipment lists them by
			// version); applied_at has milliseconds, ties keep version order.
			events := slices.Clone(sh.Events)
			slices.SortStableFunc(events, func(a, b shipment.Applied) int { return a.AppliedAt.Compare(b.AppliedAt) })
			var ids []string
			for _, e := range events {
				ids = append(ids, e.MessageID)
			}
			return ids, err
		},
	}
}

// monitored returns db on a client of its own with the kit's command
// monitor, through which it interrupts the handler between its commands.
func monitored(t *testing.T, uri string, db *mongo.Database) *mongo.Database {
	t.Helper()
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetMonitor(inboxcheck.Monitor(nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	return client.Database(db.Name())
}

// Shipping's handler passes the inbox handler kit: redelivered, after a
// crash between its effect and the record, after a crash after each of its
// own database commands, concurrently, out of order, with a cancelled
// context, and after its record expired, with the inbox configured as the
// service configures it (records buffered every 10ms).
func TestShippingHandlerPassesTheInboxCheck(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]inbox.Config{
		"as the service runs it":         {Standalone: inbox.StandaloneConfig{FlushInterval: 10 * time.Millisecond}},
		"records written before the ack": {},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := monitored(t, mongotest.URI(t), mongotest.Database(t))
			r := inboxcheck.Run(t, db, shippingSubject(t, db, cfg))
			if r.Mode != inbox.ModeStandalone {
				t.Fatalf("mode %s, want standalone on FerretDB", r.Mode)
			}
			if r.Crashes == 0 {
				t.Errorf("no delivery was interrupted inside the handler:\n%s", r)
			}
		})
	}
}

// The store alone does not wait for an order's previous version: without
// the gate, shipping's handler fails the scenarios out of order.
func TestShippingStoreWithoutTheGateFailsOutOfOrder(t *testing.T) {
	t.Parallel()
	db := monitored(t, mongotest.URI(t), mongotest.Database(t))
	s := shippingSubject(t, db, inbox.Config{})
	s.Gate = nil
	r, err := inboxcheck.Check(t.Context(), db, s)
	if err != nil {
		t.Fatal(err)
	}
	failed := map[string]bool{}
	for _, f := range r.Findings {
		if f.Problem == inboxcheck.OutOfOrder {
			failed[f.Scenario] = true
		}
	}
	if !failed["out_of_order"] || !failed["shuffled"] {
		t.Fatalf("want out of order findings in out_of_order and shuffled:\n%s", r)
	}
}

// And in transaction mode, where a replica set is available.
func TestShippingHandlerPassesTheInboxCheckInTransactionMode(t *testing.T) {
	t.Parallel()
	db := monitored(t, replsettest.URI(t), replsettest.Database(t))
	if r := inboxcheck.Run(t, db, shippingSubject(t, db, inbox.Config{})); r.Mode != inbox.ModeTransaction {
		t.Fatalf("mode %s, want transaction", r.Mode)
	}
}

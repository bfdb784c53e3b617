package mongodb_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/internal/mongolocal/replsettest"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(replsettest.Suite(m)) }

func ev(typ string, version int64) shipment.Event {
	e := shipment.Event{Type: typ, OrderID: "o-1", Version: version}
	if typ == shipment.TypeCreated {
		e.Created = &shipment.Created{OrderID: "o-1", CustomerID: "c", Currency: "EUR", Total: 10}
	} else {
		e.Cancelled = &shipment.Cancelled{OrderID: "o-1"}
	}
	return e
}

func TestApplyChainsVersions(t *testing.T) {
	t.Parallel()
	s, err := mongodb.New(mongotest.Database(t), "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := s.Get(ctx, "o-1"); !errors.Is(err, shipment.ErrNotFound) {
		t.Fatalf("Get before any event: %v, want ErrNotFound", err)
	}
	if o, err := s.Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil || o != shipment.OutcomeApplied {
		t.Fatalf("create: %v, %v", o, err)
	}
	if o, err := s.Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil || o != shipment.OutcomeAlreadyApplied {
		t.Fatalf("create again: %v, %v; want AlreadyApplied", o, err)
	}
	if _, err := s.Apply(ctx, "9", ev(shipment.TypeCreated, 1)); !errors.Is(err, shipment.ErrVersionConflict) {
		t.Fatalf("another message at version 1: %v, want ErrVersionConflict", err)
	}
	if o, err := s.Apply(ctx, "2", ev(shipment.TypeCancelled, 2)); err != nil || o != shipment.OutcomeApplied {
		t.Fatalf("cancel: %v, %v", o, err)
	}
	sh, err := s.Get(ctx, "o-1")
	if err != nil {
		t.Fatal(err)
	}
	if sh.Status != shipment.StatusCancelled || sh.Version != 2 || len(sh.Events) != 2 ||
		sh.Events[0].MessageID != "1" || sh.Events[1].MessageID != "2" || sh.Currency != "EUR" {
		t.Fatalf("shipment %+v", sh)
	}
	if err := s.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
}

func TestConcurrentCopiesOfAnEventApplyOnce(t *testing.T) {
	t.Parallel()
	s, err := mongodb.New(mongotest.Database(t), "")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		applied int
	)
	for range 8 {
		wg.Go(func() {
			o, err := s.Apply(t.Context(), "1", ev(shipment.TypeCreated, 1))
			if err != nil {
				t.Errorf("Apply: %v", err)
				return
			}
			if o == shipment.OutcomeApplied {
				mu.Lock()
				applied++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if applied != 1 {
		t.Fatalf("%d copies reported Applied, want exactly 1", applied)
	}
}

// An order's amendments are stored at their versions with their notes, and
// Get shows the last one; a copy of one is recognised by its version.
func TestApplyStoresAmendments(t *testing.T) {
	t.Parallel()
	s, err := mongodb.New(mongotest.Database(t), "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := s.Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil {
		t.Fatal(err)
	}
	amend := func(v int64) shipment.Event {
		return shipment.Event{Type: shipment.TypeAmended, OrderID: "o-1", Version: v,
			Amended: &shipment.Amended{OrderID: "o-1", Note: fmt.Sprintf("note %d", v)}}
	}
	for v := int64(2); v <= 12; v++ {
		if o, err := s.Apply(ctx, fmt.Sprintf("a%d", v), amend(v)); err != nil || o != shipment.OutcomeApplied {
			t.Fatalf("amendment v%d: %v, %v", v, o, err)
		}
	}
	if o, err := s.Apply(ctx, "a7", amend(7)); err != nil || o != shipment.OutcomeAlreadyApplied {
		t.Fatalf("v7 again: %v, %v; want AlreadyApplied", o, err)
	}
	sh, err := s.Get(ctx, "o-1")
	if err != nil || sh.Version != 12 || sh.Note != "note 12" || len(sh.Events) != 12 || sh.Events[11].EventType != shipment.TypeAmended {
		t.Fatalf("shipment %+v, %v", sh, err)
	}
}

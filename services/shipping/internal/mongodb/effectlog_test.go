package mongodb_test

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/internal/mongolocal/replsettest"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Every run of Apply that performs a message's effect (applied, or found
// applied by that message) appends an entry with an id of its own; a
// version conflict appends none. The shipment keeps one document per
// version whatever the count of runs: the log is what shows them.
func TestApplyAppendsToTheEffectLog(t *testing.T) {
	t.Parallel()
	db := mongotest.Database(t)
	s, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	// Runs of message "1" (v1): generated count, at least 1.
	runs := 1 + int(s.Writer().PID%4)
	for range runs {
		if _, err := s.Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Apply(ctx, "9", ev(shipment.TypeCreated, 1)); !errors.Is(err, shipment.ErrVersionConflict) {
		t.Fatalf("another message at v1: %v, want ErrVersionConflict", err)
	}
	log, err := s.EffectLog(ctx, "1")
	if err != nil {
		t.Fatal(err)
	}
	if len(log) != runs {
		t.Fatalf("%d runs of message 1 left %d entries: %+v", runs, len(log), log)
	}
	ids := make(map[string]bool)
	for i, e := range log {
		want := mongodb.EffectAlreadyApplied
		if i == 0 {
			want = mongodb.EffectApplied
		}
		if e.Outcome != want || e.OrderID != "o-1" || e.Version != 1 || e.EventType != shipment.TypeCreated ||
			e.Writer != s.Writer().String() || e.At.Before(e.StartedAt) || e.ID.IsZero() {
			t.Errorf("entry %d: %+v; want outcome %s, o-1 v1 %s by %s", i, e, want, shipment.TypeCreated, s.Writer())
		}
		ids[e.ID.Hex()] = true
	}
	if len(ids) != runs {
		t.Errorf("%d entries share ids: %+v", runs, log)
	}
	for _, m := range []string{"9"} {
		if log, err := s.EffectLog(ctx, m); err != nil || len(log) != 0 {
			t.Errorf("message %s, never applied: entries %+v, %v", m, log, err)
		}
	}
	// Another process (another Store) names itself apart.
	other, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	if other.Writer() == s.Writer() || other.Writer().PID != s.Writer().PID || len(other.Writer().Instance) != 16 {
		t.Fatalf("writers %s and %s", s.Writer(), other.Writer())
	}
	if _, err := other.Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil {
		t.Fatal(err)
	}
	log, err = s.EffectLog(ctx, "1")
	if err != nil || len(log) != runs+1 || log[runs].Writer != other.Writer().String() {
		t.Fatalf("after a run by %s: %+v, %v", other.Writer(), log, err)
	}
	if sh, err := s.Get(ctx, "o-1"); err != nil || len(sh.Events) != 1 {
		t.Fatalf("shipment after %s runs: %+v, %v; want one event", strconv.Itoa(runs+1), sh, err)
	}
}

// In transaction mode the entry commits with the shipment and the inbox
// record, or not at all: a handler that fails after Apply leaves no entry,
// and a redelivery after the commit is the inbox's duplicate, with no entry.
func TestEffectLogEntryCommitsWithTheTransaction(t *testing.T) {
	t.Parallel()
	db := replsettest.Database(t)
	s, err := mongodb.New(db, "")
	if err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = in.Close(context.WithoutCancel(t.Context())) }()
	ctx := t.Context()
	boom := errors.New("after the effect")
	_, err = in.Process(ctx, "1", func(ctx context.Context) error {
		if _, err := s.Apply(ctx, "1", ev(shipment.TypeCreated, 1)); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Process: %v, want the handler's error", err)
	}
	if log, err := s.EffectLog(ctx, "1"); err != nil || len(log) != 0 {
		t.Fatalf("after an aborted transaction: %+v, %v; want no entry", log, err)
	}
	for range 2 {
		if _, err := in.Process(ctx, "1", func(ctx context.Context) error {
			_, err := s.Apply(ctx, "1", ev(shipment.TypeCreated, 1))
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	if log, err := s.EffectLog(ctx, "1"); err != nil || len(log) != 1 || log[0].Outcome != mongodb.EffectApplied {
		t.Fatalf("after a commit and a duplicate: %+v, %v; want one applied entry", log, err)
	}
}

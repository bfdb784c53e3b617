package deadletter

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(mongotest.Suite(m)) }

type fakePublisher struct {
	mu        sync.Mutex
	published []string // message ids
}

func (f *fakePublisher) Publish(_ context.Context, m shipment.KeptMessage) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.published = append(f.published, m.MessageID)
	return nil
}

type fakeSkipper struct{ skipped []string }

func (f *fakeSkipper) Skip(_ context.Context, orderID string, version int64, _, _ string) error {
	f.skipped = append(f.skipped, key(orderID, version))
	return nil
}

func msg(id string) shipment.KeptMessage {
	return shipment.KeptMessage{MessageID: id, RoutingKey: "order.cancelled", Body: []byte("{}")}
}

// setup holds order o-1 behind a dead letter at version 2, with versions 3,
// 4 and 5 parked (in another order than their versions).
func setup(t *testing.T) (*Store, *fakePublisher, *fakeSkipper) {
	t.Helper()
	s, err := NewStore(mongotest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	now := time.Now().UTC()
	if err := s.Record(ctx, shipment.Letter{OrderID: "o-1", Version: 2, EventType: "order.cancelled", Reason: "handler_failed",
		Error: "boom", Holds: true, DeadLetteredAt: now, Message: msg("m2")}); err != nil {
		t.Fatal(err)
	}
	for _, v := range []int64{4, 3, 5} {
		if err := s.Park(ctx, shipment.Parked{OrderID: "o-1", Version: v, ParkedAt: now, Message: msg(fmt.Sprintf("m%d", v))}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Park(ctx, shipment.Parked{OrderID: "o-1", Version: 4, ParkedAt: now, Message: msg("m4")}); err != nil {
		t.Fatalf("parking the same message twice: %v", err)
	}
	if err := s.Park(ctx, shipment.Parked{OrderID: "o-1", Version: 4, ParkedAt: now, Message: msg("other")}); !errors.Is(err, shipment.ErrParkedConflict) {
		t.Fatalf("another message at a parked version: %v, want ErrParkedConflict", err)
	}
	return s, &fakePublisher{}, &fakeSkipper{}
}

func wantReleased(t *testing.T, s *Store) {
	t.Helper()
	letters, holds, err := s.List(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(letters) != 0 || len(holds) != 0 {
		t.Fatalf("after the release: dead letters %+v, holds %+v; want none", letters, holds)
	}
	if ps, _ := s.parkedOf(t.Context(), "o-1"); len(ps) != 0 {
		t.Fatalf("still parked: %+v", ps)
	}
}

func TestReplayRepublishesTheDeadLetterThenTheParkedInVersionOrder(t *testing.T) {
	t.Parallel()
	s, pub, skip := setup(t)
	st, err := s.Stats(t.Context(), time.Now())
	if err != nil || st.HeldOrders != 1 || st.DeadLetters != 1 || st.Parked != 3 {
		t.Fatalf("stats %+v, %v", st, err)
	}
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	n, err := m.Replay(t.Context(), "o-1", 2)
	if err != nil || n != 3 {
		t.Fatalf("Replay: %d, %v", n, err)
	}
	if want := []string{"m2", "m3", "m4", "m5"}; !slices.Equal(pub.published, want) {
		t.Fatalf("published %v, want %v", pub.published, want)
	}
	if len(skip.skipped) != 0 {
		t.Fatalf("replay skipped %v", skip.skipped)
	}
	wantReleased(t, s)
	if _, err := m.Replay(t.Context(), "o-1", 2); !errors.Is(err, shipment.ErrNoDeadLetter) {
		t.Fatalf("second Replay: %v, want shipment.ErrNoDeadLetter", err)
	}
}

func TestDiscardSkipsTheVersionThenReleasesTheParked(t *testing.T) {
	t.Parallel()
	s, pub, skip := setup(t)
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	if n, err := m.Discard(t.Context(), "o-1", 2); err != nil || n != 3 {
		t.Fatalf("Discard: %d, %v", n, err)
	}
	if !slices.Equal(skip.skipped, []string{"o-1/2"}) || !slices.Equal(pub.published, []string{"m3", "m4", "m5"}) {
		t.Fatalf("skipped %v, published %v", skip.skipped, pub.published)
	}
	wantReleased(t, s)
}

// crashAt arms the crash point shipping.release_after_publish to fire at
// its after-th hit, and returns the context to release in: firing ends it,
// as a killed process ends its work, so the release stops there, the parked
// copy of the message it just re-published not deleted.
func crashAt(t *testing.T, after int64) (context.Context, *crashpoint.Trigger) {
	ctx, cancel := context.WithCancel(t.Context())
	t.Cleanup(cancel)
	return ctx, crashpoint.New(crashpoint.ShippingReleaseAfterPublish, after, cancel)
}

func TestReleaseInterruptedMidwayResumesWithoutLossOrReorder(t *testing.T) {
	t.Parallel()
	s, pub, skip := setup(t)
	// The release dies after version 4's re-publish was confirmed, before
	// its parked copy is deleted.
	ctx, crash := crashAt(t, 2)
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip, Crash: crash})
	if _, err := m.Replay(ctx, "o-1", 2); !errors.Is(err, context.Canceled) {
		t.Fatalf("Replay: %v, want the crash", err)
	}
	h, err := s.Held(t.Context(), "o-1")
	if err != nil || h == nil || h.State != shipment.StateReleasing {
		t.Fatalf("hold after the crash: %+v, %v; want it releasing", h, err)
	}

	// The operator runs it again: it resumes.
	m, _ = NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	if _, err := m.Replay(t.Context(), "o-1", 2); err != nil {
		t.Fatalf("resumed Replay: %v", err)
	}
	// Nothing lost; version 4 went out twice (the consumer's inbox absorbs
	// the copy); first publications in version order.
	if want := []string{"m2", "m3", "m4", "m4", "m5"}; !slices.Equal(pub.published, want) {
		t.Fatalf("published %v, want %v", pub.published, want)
	}
	wantReleased(t, s)
}

func TestAReplayThatFailsAgainHoldsTheOrderAnew(t *testing.T) {
	t.Parallel()
	s, _, skip := setup(t)
	// The replayed message is dead-lettered again while the release runs.
	pub := publishFunc(func(ctx context.Context, m shipment.KeptMessage) error {
		if m.MessageID == "m2" {
			return s.Record(ctx, shipment.Letter{OrderID: "o-1", Version: 2, Reason: "handler_failed", Holds: true,
				DeadLetteredAt: time.Now().UTC().Add(time.Second), Message: msg("m2")})
		}
		return nil
	})
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	if _, err := m.Replay(t.Context(), "o-1", 2); err != nil {
		t.Fatal(err)
	}
	h, err := s.Held(t.Context(), "o-1")
	if err != nil || h == nil || h.State != shipment.StateHeld {
		t.Fatalf("hold %+v, %v: want the order held again", h, err)
	}
	if letters, _, err := s.List(t.Context()); err != nil || len(letters) != 1 || letters[0].Message.MessageID != "m2" {
		t.Fatalf("dead letters %+v, %v: want the new one of m2 kept", letters, err)
	}
}

type publishFunc func(ctx context.Context, m shipment.KeptMessage) error

func (f publishFunc) Publish(ctx context.Context, m shipment.KeptMessage) error { return f(ctx, m) }

func TestResumeFinishesAnInterruptedDiscard(t *testing.T) {
	t.Parallel()
	s, pub, skip := setup(t)
	ctx, crash := crashAt(t, 1)
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip, Crash: crash})
	if _, err := m.Discard(ctx, "o-1", 2); !errors.Is(err, context.Canceled) {
		t.Fatalf("Discard: %v, want the crash", err)
	}
	// The service restarts and resumes what was interrupted.
	m, _ = NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	if n, err := m.Resume(t.Context()); err != nil || n != 1 {
		t.Fatalf("Resume: %d, %v; want 1 release finished", n, err)
	}
	if want := []string{"m3", "m3", "m4", "m5"}; !slices.Equal(pub.published, want) {
		t.Fatalf("published %v, want %v", pub.published, want)
	}
	if !slices.Equal(skip.skipped, []string{"o-1/2"}) {
		t.Fatalf("skipped %v: the discard must not turn into a replay", skip.skipped)
	}
	wantReleased(t, s)
	if n, err := m.Resume(t.Context()); err != nil || n != 0 {
		t.Fatalf("Resume with nothing to do: %d, %v", n, err)
	}
}

// A held version applied after all releases its order: the parked versions
// go out in order, the dead letter and the hold are gone, and nothing is
// re-published of the dead letter itself (its version is applied). Any
// other version, or an order that is not held, changes nothing.
func TestAppliedHeldVersionReleasesItsOrder(t *testing.T) {
	t.Parallel()
	s, pub, skip := setup(t)
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	for _, tc := range []struct {
		order   string
		version int64
	}{{"o-1", 1}, {"o-1", 3}, {"o-2", 2}} {
		if n, err := m.Applied(t.Context(), tc.order, tc.version); err != nil || n != 0 {
			t.Fatalf("Applied(%s, %d): %d, %v; want nothing released", tc.order, tc.version, n, err)
		}
	}
	if h, err := s.Held(t.Context(), "o-1"); err != nil || h == nil || h.State != shipment.StateHeld || len(pub.published) != 0 {
		t.Fatalf("hold %+v, %v, published %v: want o-1 still held, nothing published", h, err, pub.published)
	}
	if n, err := m.Applied(t.Context(), "o-1", 2); err != nil || n != 3 {
		t.Fatalf("Applied(o-1, 2): %d, %v; want 3 released", n, err)
	}
	if want := []string{"m3", "m4", "m5"}; !slices.Equal(pub.published, want) {
		t.Fatalf("published %v, want %v", pub.published, want)
	}
	if len(skip.skipped) != 0 {
		t.Fatalf("skipped %v", skip.skipped)
	}
	wantReleased(t, s)
}

func TestResumeFinishesAnInterruptedReleaseOfAnAppliedVersion(t *testing.T) {
	t.Parallel()
	s, pub, skip := setup(t)
	ctx, crash := crashAt(t, 1)
	m, _ := NewManager(Config{Store: s, Publisher: pub, Skipper: skip, Crash: crash})
	if _, err := m.Applied(ctx, "o-1", 2); !errors.Is(err, context.Canceled) {
		t.Fatalf("Applied: %v, want the crash", err)
	}
	m, _ = NewManager(Config{Store: s, Publisher: pub, Skipper: skip})
	if n, err := m.Resume(t.Context()); err != nil || n != 1 {
		t.Fatalf("Resume: %d, %v; want 1 release finished", n, err)
	}
	if want := []string{"m3", "m3", "m4", "m5"}; !slices.Equal(pub.published, want) {
		t.Fatalf("published %v, want %v (no replay of the applied version)", pub.published, want)
	}
	wantReleased(t, s)
}

package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

func recordedIDs(t *testing.T, in *inbox.Inbox, since time.Time, pageSize int) string {
	t.Helper()
	var ids []string
	for m, err := range in.Recorded(t.Context(), since, pageSize) {
		if err != nil {
			t.Fatalf("Recorded: %v", err)
		}
		if m.ProcessedAt.IsZero() {
			t.Errorf("message %s: no processed_at", m.MessageID)
		}
		ids = append(ids, m.MessageID)
	}
	return strings.Join(ids, " ")
}

// Recorded yields this consumer's done records, and only those, in byte
// order of their ids, across pages of any size, from a processed_at on.
func TestRecordedYieldsDoneRecordsInIDOrder(t *testing.T) {
	t.Parallel()
	db := inboxtest.Database(t)
	b := setup(t, db, inbox.Config{Consumer: "test", Standalone: inbox.StandaloneConfig{Lease: time.Minute}})
	// Consumers whose names extend or prefix this one share the collection.
	for _, consumer := range []string{"test2", "tes", "test-2"} {
		other := setup(t, db, inbox.Config{Consumer: consumer})
		if _, err := other.in.Process(t.Context(), "5", other.apply("5")); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"9", "10", "2", "abc", "1"} {
		if _, err := b.in.Process(t.Context(), id, b.apply(id)); err != nil {
			t.Fatal(err)
		}
	}
	// A failed handler leaves no record, a running one only a claim.
	if _, err := b.in.Process(t.Context(), "3", func(context.Context) error { return errors.New("boom") }); !errors.Is(err, inbox.ErrHandler) {
		t.Fatalf("Process: %v, want ErrHandler", err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := b.in.Process(context.WithoutCancel(t.Context()), "4", func(context.Context) error {
			close(entered)
			<-release
			return nil
		})
		done <- err
	}()
	<-entered

	const want = "1 10 2 9 abc"
	for _, size := range []int{1, 2, 3, 5, 0} {
		if got := recordedIDs(t, b.in, time.Time{}, size); got != want {
			t.Fatalf("page size %d: %q, want %q", size, got, want)
		}
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := recordedIDs(t, b.in, time.Time{}, 2); got != "1 10 2 4 9 abc" {
		t.Fatalf("after the claim turned done: %q", got)
	}

	// processed_at: only the records made after since.
	t0 := time.Now()
	for time.Since(t0) < 2*time.Millisecond { // BSON dates have milliseconds
		time.Sleep(100 * time.Microsecond)
	}
	if _, err := b.in.Process(t.Context(), "8", b.apply("8")); err != nil {
		t.Fatal(err)
	}
	if got := recordedIDs(t, b.in, t0.Add(time.Millisecond), 2); got != "8" {
		t.Fatalf("since %v: %q, want 8", t0, got)
	}

	// Stopping early ends the scan; a negative page size is an error.
	for _, err := range b.in.Recorded(t.Context(), time.Time{}, 1) {
		if err != nil {
			t.Fatal(err)
		}
		break
	}
	for _, err := range b.in.Recorded(t.Context(), time.Time{}, -1) {
		if err == nil || !strings.Contains(err.Error(), "page size") {
			t.Fatalf("page size -1: %v", err)
		}
	}
}

package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"

	"github.com/outbox-inbox/reference/internal/mongolocal/replsettest"
	"github.com/outbox-inbox/reference/pkg/inbox"
)

// These tests need a replica set (TEST_MONGO_REPLSET_URI, or Docker for a
// testcontainers one); without one they skip, saying so. Their effect is
// deliberately NOT idempotent: the transaction alone must keep it to one.

func replicaSet(t *testing.T, cfg inbox.Config) *bundle {
	t.Helper()
	return setup(t, replsettest.Database(t), cfg)
}

func TestTransactionModeIsDetectedAndHasTTL(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	mode, err := b.in.Mode(t.Context())
	if err != nil || mode != inbox.ModeTransaction {
		t.Fatalf("Mode = %q, %v; want %q on a replica set", mode, err, inbox.ModeTransaction)
	}
	if !b.in.TTL() {
		t.Fatal("TTL() = false after EnsureIndexes on MongoDB")
	}
}

func TestTransactionModeRedeliveriesProduceOneEffect(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	for i := range 4 {
		res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
		want := inbox.Duplicate
		if i == 0 {
			want = inbox.Processed
		}
		if err != nil || res != want {
			t.Fatalf("delivery %d: %v, %v; want %v", i+1, res, err, want)
		}
	}
	b.exactlyOnce(t, "m-1")
}

func TestTransactionModeConcurrentDuplicatesProduceOneEffect(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{MaxTransactionAttempts: 20})
	const messages, deliveries = 8, 6
	start := make(chan struct{})
	var wg sync.WaitGroup
	ids := make([]string, messages)
	for m := range messages {
		ids[m] = fmt.Sprintf("m-%d", m)
		for range deliveries {
			wg.Go(func() {
				<-start
				if _, err := b.in.Process(t.Context(), ids[m], b.applyPlain(ids[m])); err != nil {
					t.Errorf("Process(%s): %v", ids[m], err)
				}
			})
		}
	}
	close(start)
	wg.Wait()
	b.exactlyOnce(t, ids...)
}

func TestTransactionModeHandlerErrorRollsBackItsWrites(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	boom := errors.New("boom")
	_, err := b.in.Process(t.Context(), "m-1", func(ctx context.Context) error {
		if err := b.applyPlain("m-1")(ctx); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, inbox.ErrHandler) || !errors.Is(err, boom) {
		t.Fatalf("Process: %v, want ErrHandler wrapping the handler's error", err)
	}
	b.exactlyOnce(t) // the write made before the error was rolled back
	b.mustBeDone(t, "m-1", false)

	res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
	if err != nil || res != inbox.Processed {
		t.Fatalf("retry: %v, %v", res, err)
	}
	b.exactlyOnce(t, "m-1")
}

func TestTransactionModeCrashAfterEffectCommitsNothing(t *testing.T) {
	t.Parallel()
	b := replicaSet(t, inbox.Config{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = b.in.Process(t.Context(), "m-1", func(ctx context.Context) error {
			if err := b.applyPlain("m-1")(ctx); err != nil {
				return err
			}
			runtime.Goexit() // dies before the commit
			return nil
		})
	}()
	<-done
	b.exactlyOnce(t)
	res, err := b.in.Process(t.Context(), "m-1", b.applyPlain("m-1"))
	if err != nil || res != inbox.Processed {
		t.Fatalf("redelivery: %v, %v", res, err)
	}
	b.exactlyOnce(t, "m-1")
}

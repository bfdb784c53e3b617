package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/inbox"
)

// stepLog records the steps Hooks see, and checks that each step's context
// is the one StartStep returned and that the handler never runs with one.
type stepLog struct {
	mu    sync.Mutex
	steps []string
	bad   []string
}

type stepKey struct{}

func (l *stepLog) hooks() inbox.Hooks {
	return inbox.Hooks{
		StartStep: func(ctx context.Context, step inbox.Step, msgID string) context.Context {
			return context.WithValue(ctx, stepKey{}, step.String()+"/"+msgID)
		},
		EndStep: func(ctx context.Context, step inbox.Step, msgID string, r inbox.StepResult) {
			l.mu.Lock()
			defer l.mu.Unlock()
			if got := ctx.Value(stepKey{}); got != step.String()+"/"+msgID {
				l.bad = append(l.bad, fmt.Sprintf("EndStep(%s, %s) with the context of %v", step, msgID, got))
			}
			s := step.String()
			switch {
			case r.Err != nil:
				s += " error"
			case r.Duplicate && r.Cached:
				s += " duplicate cached"
			case r.Duplicate:
				s += " duplicate"
			case r.Buffered:
				s += " buffered"
			}
			l.steps = append(l.steps, s)
		},
	}
}

// handler wraps h: it logs its run and fails the test's log if it sees a
// step's context.
func (l *stepLog) handler(h inbox.Handler) inbox.Handler {
	return func(ctx context.Context) error {
		l.mu.Lock()
		if v := ctx.Value(stepKey{}); v != nil {
			l.bad = append(l.bad, fmt.Sprintf("handler ran with the context of step %v", v))
		}
		l.steps = append(l.steps, "handler")
		l.mu.Unlock()
		return h(ctx)
	}
}

// take returns the steps seen since the last take.
func (l *stepLog) take(t *testing.T) string {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.bad) > 0 {
		t.Fatalf("hooks: %s", strings.Join(l.bad, "; "))
	}
	s := strings.Join(l.steps, ", ")
	l.steps = nil
	return s
}

func TestHooksSeeTheCheckAndTheRecordAroundTheHandler(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  inbox.Config
		// first, again (a duplicate found in the database), cached (found
		// in the done cache), failing (a handler error)
		first, again, failing string
	}{
		{
			name:    "synchronous records",
			cfg:     inbox.Config{Mode: inbox.ModeStandalone},
			first:   "check, handler, record",
			again:   "check duplicate",
			failing: "check, handler",
		},
		{
			name:    "buffered records",
			cfg:     inbox.Config{Mode: inbox.ModeStandalone, Standalone: inbox.StandaloneConfig{FlushInterval: 10 * time.Millisecond}},
			first:   "check, handler, record buffered",
			again:   "check duplicate",
			failing: "check, handler",
		},
		{
			name:    "lease",
			cfg:     inbox.Config{Mode: inbox.ModeStandalone, Standalone: inbox.StandaloneConfig{Lease: time.Minute}},
			first:   "check, handler, record",
			again:   "check duplicate",
			failing: "check, handler",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var log stepLog
			cfg := tc.cfg
			cfg.Hooks = log.hooks()
			cfg.DoneCacheSize = -1 // the database answers the second delivery
			b := standalone(t, cfg)
			t.Cleanup(func() { _ = b.in.Close(context.Background()) })
			ctx := t.Context()

			res, err := b.in.Process(ctx, "m-1", log.handler(b.apply("m-1")))
			if err != nil || res != inbox.Processed {
				t.Fatalf("first Process: %v, %v", res, err)
			}
			if got := log.take(t); got != tc.first {
				t.Fatalf("first delivery: steps %q, want %q", got, tc.first)
			}
			if err := b.in.Close(ctx); err != nil { // write a buffered record
				t.Fatal(err)
			}
			res, err = b.in.Process(ctx, "m-1", log.handler(b.apply("m-1")))
			if err != nil || res != inbox.Duplicate {
				t.Fatalf("second Process: %v, %v", res, err)
			}
			if got := log.take(t); got != tc.again {
				t.Fatalf("second delivery: steps %q, want %q", got, tc.again)
			}
			boom := errors.New("boom")
			_, err = b.in.Process(ctx, "m-2", log.handler(func(context.Context) error { return boom }))
			if !errors.Is(err, boom) || !errors.Is(err, inbox.ErrHandler) {
				t.Fatalf("failing handler: Process returned %v", err)
			}
			if got := log.take(t); got != tc.failing {
				t.Fatalf("failing handler: steps %q, want %q", got, tc.failing)
			}
			b.exactlyOnce(t, "m-1")
		})
	}
}

func TestHooksSeeADuplicateAnsweredByTheDoneCache(t *testing.T) {
	t.Parallel()
	var log stepLog
	b := standalone(t, inbox.Config{Mode: inbox.ModeStandalone, Hooks: log.hooks()})
	ctx := t.Context()
	for range 2 {
		if _, err := b.in.Process(ctx, "m-1", log.handler(b.apply("m-1"))); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := log.take(t), "check, handler, record, check duplicate cached"; got != want {
		t.Fatalf("steps %q, want %q", got, want)
	}
	b.exactlyOnce(t, "m-1")
}

func TestStepString(t *testing.T) {
	for s, want := range map[inbox.Step]string{inbox.StepCheck: "check", inbox.StepRecord: "record", 7: "Step(7)"} {
		if got := s.String(); got != want {
			t.Errorf("Step(%d).String() = %q, want %q", int(s), got, want)
		}
	}
}

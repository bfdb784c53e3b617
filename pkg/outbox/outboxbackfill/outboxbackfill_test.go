package outboxbackfill_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxbackfill"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// archived makes an outbox whose relay published events aggregates × each
// (o-0 ... o-<aggregates-1>) to a Recorder, and returns the pool, what the
// relay published, and a moment after the last mark.
func archived(t *testing.T, aggregates, each int) (*pgxpool.Pool, []outbox.Envelope, time.Time) {
	t.Helper()
	pool := outboxtest.Pool(t)
	for v := range each {
		for a := range aggregates {
			outboxtest.Enqueue(t, pool, outboxtest.Msg(fmt.Sprintf("o-%d", a), fmt.Sprintf("order.v%d", v+1)))
		}
	}
	rec := outboxtest.NewRecorder()
	outboxtest.StartRelay(t, pool, rec, outbox.RelayConfig{PollInterval: 10 * time.Millisecond, Logger: outboxtest.Logger(t)})
	outboxtest.WaitFor(t, "the relay to publish everything", 60*time.Second, outboxtest.OutboxEmpty(pool))
	var now time.Time
	if err := pool.QueryRow(context.Background(), "SELECT clock_timestamp()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	return pool, rec.Published(), now
}

func TestNewValidatesTheConfig(t *testing.T) {
	t.Parallel()
	target := outboxtest.NewRecorder()
	now := time.Now()
	for _, c := range []struct {
		name string
		cfg  outboxbackfill.Config
	}{
		{"no name", outboxbackfill.Config{}},
		{"long name", outboxbackfill.Config{Name: string(make([]byte, 201))}},
		{"until before from", outboxbackfill.Config{Name: "n", From: now, Until: now.Add(-time.Second)}},
		{"negative rate", outboxbackfill.Config{Name: "n", Rate: -1}},
		{"NaN rate", outboxbackfill.Config{Name: "n", Rate: math.NaN()}},
		{"large batch", outboxbackfill.Config{Name: "n", BatchSize: outboxbackfill.MaxBatchSize + 1}},
		{"negative timeout", outboxbackfill.Config{Name: "n", PublishTimeout: -time.Second}},
		{"backoff inverted", outboxbackfill.Config{Name: "n", RetryBackoffMin: time.Minute, RetryBackoffMax: time.Second}},
	} {
		if _, err := outboxbackfill.New(outboxtest.SchemaPool(t), target, c.cfg); err == nil {
			t.Errorf("%s: New accepted %+v", c.name, c.cfg)
		}
	}
	if _, err := outboxbackfill.New(outboxtest.SchemaPool(t), target, outboxbackfill.Config{Name: "n"}); err != nil {
		t.Fatalf("New with defaults: %v", err)
	}
}

// The replay sends the selected aggregates' archived events as the relay
// published them, each aggregate in version order; a finished backfill
// runs again as a no-op, and its name refuses another selection.
func TestRunReplaysTheSelectionInOrder(t *testing.T) {
	t.Parallel()
	pool, published, until := archived(t, 5, 6)
	ctx := context.Background()
	target := outboxtest.NewRecorder()
	cfg := outboxbackfill.Config{
		Name: "billing", Until: until, BatchSize: 4, Rate: 10_000, Logger: outboxtest.Logger(t),
		Aggregates: []outboxbackfill.Aggregate{{"order", "o-3"}, {"order", "o-1"}, {"order", "o-3"}},
	}
	b, err := outboxbackfill.New(pool, target, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Run(ctx); err != nil {
		t.Fatal(err)
	}
	want := map[int64]outbox.Envelope{}
	for _, e := range published {
		if e.AggregateID == "o-1" || e.AggregateID == "o-3" {
			want[e.ID] = e
		}
	}
	got := target.Published()
	if len(got) != len(want) {
		t.Fatalf("replayed %d events, want %d", len(got), len(want))
	}
	next := map[string]int64{}
	for _, e := range got {
		w, ok := want[e.ID]
		if !ok {
			t.Fatalf("replayed event %d of %s, not selected", e.ID, e.AggregateID)
		}
		if e.MessageID() != w.MessageID() || string(e.Payload) != string(w.Payload) || !maps.Equal(e.Headers, w.Headers) ||
			e.EventType != w.EventType || e.AggregateVersion != w.AggregateVersion {
			t.Errorf("replayed %+v, the relay published %+v", e, w)
		}
		if want := next[e.AggregateID] + 1; e.AggregateVersion != want {
			t.Errorf("replayed %s version %d, want %d", e.AggregateID, e.AggregateVersion, want)
		}
		next[e.AggregateID] = e.AggregateVersion
	}
	if p := b.Progress(); !p.Finished || p.Replayed != int64(len(want)) || p.Total != int64(len(want)) {
		t.Errorf("progress %+v, want finished with %d of %d", p, len(want), len(want))
	}

	again, err := outboxbackfill.New(pool, target, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := again.Run(ctx); err != nil || len(target.Published()) != len(want) {
		t.Fatalf("a finished backfill ran again: %v, %d events sent", err, len(target.Published())-len(want))
	}
	cfg.Aggregates = nil
	other, err := outboxbackfill.New(pool, target, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Run(ctx); !errors.Is(err, outboxbackfill.ErrOtherSelection) {
		t.Fatalf("another selection under the same name: %v, want ErrOtherSelection", err)
	}
}

// Rate bounds the events sent per second.
func TestRunKeepsToTheRate(t *testing.T) {
	t.Parallel()
	pool, _, until := archived(t, 10, 5) // 50 events
	b, err := outboxbackfill.New(pool, outboxtest.NewRecorder(), outboxbackfill.Config{
		Name: "paced", Until: until, BatchSize: 10, Rate: 100, Logger: outboxtest.Logger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := b.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	// 50 events at 100/s, in batches of 10: five pauses of 100 ms.
	if took := time.Since(start); took < 450*time.Millisecond {
		t.Fatalf("50 events at 100 a second took %v", took)
	}
}

// failing fails its first publishes with err, then confirms.
type failing struct {
	*outboxtest.Recorder
	mu    sync.Mutex
	fails int
	err   error
}

func (f *failing) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	f.mu.Lock()
	fail := f.fails > 0
	f.fails--
	f.mu.Unlock()
	if !fail {
		return f.Recorder.PublishBatch(ctx, msgs)
	}
	errs := make([]error, len(msgs))
	for i := range errs {
		errs[i] = f.err
	}
	return errs
}

// A message the broker cannot route (no such queue) ends Run; other
// failures are retried.
func TestRunStopsOnUnroutableAndRetriesTheRest(t *testing.T) {
	t.Parallel()
	pool, published, until := archived(t, 2, 2)
	cfg := outboxbackfill.Config{Name: "q", Until: until, RetryBackoffMin: time.Millisecond, Logger: outboxtest.Logger(t)}

	noQueue := &failing{Recorder: outboxtest.NewRecorder(), fails: 1, err: fmt.Errorf("returned: %w", outbox.ErrUnroutable)}
	b, err := outboxbackfill.New(pool, noQueue, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Run(context.Background()); !errors.Is(err, outbox.ErrUnroutable) {
		t.Fatalf("Run to a missing queue: %v, want ErrUnroutable", err)
	}

	flaky := &failing{Recorder: outboxtest.NewRecorder(), fails: 3, err: errors.New("connection lost")}
	b, err = outboxbackfill.New(pool, flaky, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := flaky.Distinct(); got != len(published) {
		t.Fatalf("replayed %d events after failures, want %d", got, len(published))
	}
}

package outbox_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// Any message Enqueue accepts, the polling relay claims and hands to its
// publisher, payload as jsonb prints it; anything else Enqueue refuses with
// ErrInvalidMessage, having written nothing. The measure of the text form
// Enqueue bounds is never below what the relay got, and exact on jsonb's own
// output. The seed corpus (FuzzSeeds, testdata/fuzz) runs in every go test;
// make fuzz explores from it.
func FuzzEnqueueToPollingRelay(f *testing.F) {
	outboxtest.FuzzSeeds(f)
	pool := newTestPool(f)
	rec := outboxtest.NewRecorder()
	cfg := outbox.RelayConfig{
		PollInterval:    20 * time.Millisecond,
		RetryBackoffMin: 10 * time.Millisecond,
		RetryBackoffMax: 50 * time.Millisecond,
		Logger:          slog.New(slog.DiscardHandler), // f.Log may not run inside the fuzz function
	}
	relay := startRelay(f, pool, rec, cfg)
	f.Fuzz(func(t *testing.T, aggregateID, eventType string, payload []byte, headerName, headerValue string) {
		m := outboxtest.FuzzMessage(aggregateID, eventType, payload, headerName, headerValue)
		env, ok := outboxtest.PublishedOrRefused(t, pool, rec, m, 30*time.Second, relay.Wake)
		if !ok {
			return
		}
		measured, err := outbox.JSONBTextSize(payload)
		if err != nil || measured < int64(len(env.Payload)) {
			t.Fatalf("Enqueue measured the payload's text form as %d bytes (%v); the relay got %d", measured, err, len(env.Payload))
		}
		if exact, err := outbox.JSONBTextSize(env.Payload); err != nil || exact != int64(len(env.Payload)) {
			t.Fatalf("jsonb's own text of %d bytes measured as %d (%v)", len(env.Payload), exact, err)
		}
	})
}

package outboxwal_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// Any message Enqueue accepts, the WAL relay decodes from the stream and
// hands to its publisher, payload as jsonb prints it (what the server's
// decoding sends); anything else Enqueue refuses with ErrInvalidMessage,
// having written nothing. The seed corpus (outboxtest.FuzzSeeds,
// testdata/fuzz) runs in every go test; make fuzz explores from it.
func FuzzEnqueueToWALRelay(f *testing.F) {
	outboxtest.FuzzSeeds(f)
	pool := walPool(f)
	rec := outboxtest.NewRecorder()
	cfg := walConfig(f, pool)
	cfg.Logger = slog.New(slog.DiscardHandler) // f.Log may not run inside the fuzz function
	relay, _ := startWAL(f, pool, rec, cfg)
	waitActive(f, relay)
	f.Fuzz(func(t *testing.T, aggregateID, eventType string, payload []byte, headerName, headerValue string) {
		m := outboxtest.FuzzMessage(aggregateID, eventType, payload, headerName, headerValue)
		outboxtest.PublishedOrRefused(t, pool, rec, m, 30*time.Second, nil)
	})
}

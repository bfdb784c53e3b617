package outboxwal_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// invalidateSlot writes WAL past max_slot_wal_keep_size behind slot (a
// bulk table, segment switches) and checkpoints until PostgreSQL marks the
// slot lost (pg_replication_slots.wal_status = 'lost'). A relay streaming
// from it has its WAL sender terminated.
func invalidateSlot(t *testing.T, s *outboxtest.PGServer, slot string) {
	t.Helper()
	pool := serverPool(t, s.URL("postgres"))
	waitFor(t, "the slot invalidated by max_slot_wal_keep_size", time.Minute, func() (bool, error) {
		for _, q := range []string{
			`CREATE TABLE IF NOT EXISTS wal_filler (pad text)`,
			`INSERT INTO wal_filler SELECT repeat('x', 1000) FROM generate_series(1, 3000)`,
			`SELECT pg_switch_wal()`,
			`CHECKPOINT`,
		} {
			if _, err := pool.Exec(context.Background(), q); err != nil {
				return false, err
			}
		}
		var status string
		err := pool.QueryRow(context.Background(), `SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&status)
		return status == "lost", err
	})
}

// A slot PostgreSQL invalidated past max_slot_wal_keep_size ("wal_status =
// lost") cannot be streamed from any more, and the rows written meanwhile
// are missing from whatever the slot still holds. The relay must notice,
// make the slot again and hand every row still in the outbox over to
// polling: nothing is lost, and each aggregate's events stay in order. Here
// the relay streams while its publisher refuses every batch (a broker
// outage: the slot's position stays behind the held events), the slot is
// invalidated under it, and events are also written after the invalidation.
func TestSlotInvalidatedByMaxSlotWALKeepSizeLosesNothing(t *testing.T) {
	s := migratedServer(t, "max_slot_wal_keep_size=1MB")
	pool := serverPool(t, s.URL("postgres"))
	br := newBroker(t, "#")
	pub := &pausablePublisher{Publisher: newPublisherForTest(t, br)}
	cfg := walFromServer(t)
	logs := &logRecorder{}
	cfg.Logger = slog.New(logs)
	relay, _ := startWAL(t, pool, pub, cfg)
	waitActive(t, relay)

	before := enqueue(t, pool, msg("a", "order.created"), msg("b", "order.created"))
	br.waitIDs("the events published before the invalidation", before)
	pub.paused.Store(true)
	held := enqueue(t, pool, msg("a", "order.paid"), msg("c", "order.created"))
	invalidateSlot(t, s, cfg.Slot)
	during := enqueue(t, pool, msg("c", "order.paid"), msg("d", "order.created"))
	pub.paused.Store(false)
	after := enqueue(t, pool, msg("a", "order.shipped"), msg("d", "order.paid"))

	got := br.waitIDs("the held events, those written during and after the invalidation",
		append(append(held, during...), after...))
	checkAggregateOrder(t, got)
	waitFor(t, "the outbox swept", 30*time.Second, outboxEmpty(pool))
	waitFor(t, "a slot streamed from again", 30*time.Second, func() (bool, error) {
		st, err := outboxwal.Slot(context.Background(), pool, cfg.Slot)
		return st.Exists && st.Active, err
	})
	var status string
	if err := s.QueryRow(t, `SELECT wal_status FROM pg_replication_slots WHERE slot_name = '`+cfg.Slot+`'`, &status); err != nil || status == "lost" {
		t.Fatalf("slot wal_status %q, %v: want a new slot, not the lost one", status, err)
	}
	if !logs.has("invalidated") {
		t.Error("the relay did not log that the slot was invalidated")
	}
}

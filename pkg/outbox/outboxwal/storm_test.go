package outboxwal_test

import (
	"context"
	"log/slog"
	"testing"
	"time"
)

// A table added to the relay's publication behind its back: its changes
// reach the stream, and the relay skips them. It used to fail decoding them
// as outbox rows ("column id missing"), reconnect, read the same change
// again, and so on, without ever getting to the outbox's next event.
func TestChangesOfOtherTablesAreSkipped(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	logs := &logRecorder{}
	cfg.Logger = slog.New(logs)
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	for _, q := range []string{
		`CREATE TABLE other (note text)`,
		`ALTER PUBLICATION ` + cfg.Publication + ` ADD TABLE other`,
		`INSERT INTO other VALUES ('not an event')`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	ev := enqueue(t, pool, msg("a", "order.created"))
	b.waitIDs("the event after the other table's insert", ev)
	if n := logs.count("replication stopped"); n != 0 {
		t.Fatalf("the relay reconnected %d times", n)
	}
}

// A publication of that name that publishes other tables too is refused
// with a clear error, and retried with a growing backoff: the relay would
// decode every change of those tables and the slot would keep WAL for them.
func TestPublicationOfOtherTablesIsRefused(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	logs := &logRecorder{}
	cfg.Logger = slog.New(logs)
	if _, err := pool.Exec(ctx, `CREATE PUBLICATION `+cfg.Publication+` FOR ALL TABLES`); err != nil {
		t.Fatal(err)
	}
	relay, _ := startWAL(t, pool, &gatePublisher{}, cfg)
	waitFor(t, "the refusal", 10*time.Second, func() (bool, error) { return logs.count("replication stopped") > 0, nil })
	time.Sleep(3 * time.Second)
	if relay.Stats().Active {
		t.Fatal("the relay streams from a publication of all tables")
	}
	if n := logs.count("replication stopped"); n > 6 {
		t.Fatalf("%d attempts in about 3s: no backoff", n)
	}
}

// A row the relay cannot decode (here a header that is not a string,
// inserted by hand) is dead-lettered by id; the relay goes on with the rest.
func TestUndecodableRowIsDeadLettered(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	relay, _ := startWAL(t, pool, newPublisherForTest(t, b), cfg)
	waitActive(t, relay)
	var bad int64
	if err := pool.QueryRow(ctx, `
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
VALUES ('order', 'bad', 1, 'order.created', '{}', '{"n": 1}') RETURNING id`).Scan(&bad); err != nil {
		t.Fatal(err)
	}
	ev := enqueue(t, pool, msg("a", "order.created"))
	b.waitIDs("the event after the undecodable row", ev)
	waitFor(t, "the undecodable row dead-lettered", 10*time.Second, func() (bool, error) {
		return count(t, pool, `SELECT count(*) FROM outbox WHERE id = $1 AND dead_lettered_at IS NOT NULL AND last_error LIKE '%cannot decode%'`, bad) == 1, nil
	})
}

// An error that comes back at every session (here the publication dropped
// under the slot: the stream cannot decode past the drop) is retried with a
// growing backoff, not at once: every session is a new WAL sender reading
// again from the slot's restart point.
func TestSessionsThatMakeNoProgressBackOff(t *testing.T) {
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	logs := &logRecorder{}
	cfg.Logger = slog.New(logs)
	relay, _ := startWAL(t, pool, &gatePublisher{}, cfg)
	waitActive(t, relay)
	if _, err := pool.Exec(ctx, `DROP PUBLICATION `+cfg.Publication); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, msg("a", "order.created"))
	waitFor(t, "the stream failing", 10*time.Second, func() (bool, error) { return logs.count("replication stopped") > 0, nil })
	time.Sleep(4 * time.Second)
	if n := logs.count("replication stopped"); n > 7 {
		t.Fatalf("%d sessions in about 4s: no backoff", n)
	}
}

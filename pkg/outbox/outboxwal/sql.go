package outboxwal

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// handedOverIndexes make the hand-over cheap to find: the polling relay's
// claim of handed-over rows, and the relay's list of aggregates held back.
// Both are partial on last_error, which the relay never sets on the rows it
// publishes itself, so they stay empty while nothing fails and cost writers
// nothing.
var handedOverIndexes = map[string]string{
	handedOverIndexName: `CREATE INDEX IF NOT EXISTS ` + handedOverIndexName + `
    ON outbox (next_attempt_at, id)
    WHERE last_error IS NOT NULL AND dead_lettered_at IS NULL AND NOT blocked`,
	handedOverAggIndexName: `CREATE INDEX IF NOT EXISTS ` + handedOverAggIndexName + `
    ON outbox (aggregate_type, aggregate_id) WHERE last_error IS NOT NULL`,
}

// outboxSchema returns the schema of the outbox table in db's search_path.
func outboxSchema(ctx context.Context, db outbox.DB) (string, error) {
	var schema *string
	err := db.QueryRow(ctx, `
SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass('outbox')`).Scan(&schema)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && schema == nil) {
		return "", fmt.Errorf("%w: no outbox table in the search_path", outbox.ErrSchemaMissing)
	}
	if err != nil {
		return "", fmt.Errorf("find the outbox table: %w", err)
	}
	return *schema, nil
}

// ensurePublication creates the outbox_wal_slots table (Schema) and the
// publication of the outbox table's inserts, if missing, and returns the
// outbox table's schema. A publication of that name that publishes anything
// else than the outbox is refused: the relay would decode and skip every
// change of those tables, and the slot would retain WAL for them.
func ensurePublication(ctx context.Context, db outbox.DB, publication string) (string, error) {
	if err := outbox.CheckSchema(ctx, db); err != nil {
		return "", err
	}
	schema, err := outboxSchema(ctx, db)
	if err != nil {
		return "", err
	}
	if err := ensureSlotsTable(ctx, db); err != nil {
		return "", err
	}
	if err := ensureHandedOverIndexes(ctx, db, schema); err != nil {
		return "", err
	}
	table := pgx.Identifier{schema, "outbox"}.Sanitize()
	for range 3 {
		var (
			pubExists, allTables, hasTable bool
			others                         []string
		)
		err := db.QueryRow(ctx, `
SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
       coalesce((SELECT puballtables FROM pg_publication WHERE pubname = $1), false),
       EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = 'outbox'),
       coalesce((SELECT array_agg(format('%I.%I', schemaname, tablename)) FROM pg_publication_tables
                 WHERE pubname = $1 AND NOT (schemaname = $2 AND tablename = 'outbox')), '{}')`,
			publication, schema).Scan(&pubExists, &allTables, &hasTable, &others)
		if err != nil {
			return "", fmt.Errorf("look for publication %s: %w", publication, err)
		}
		switch {
		case allTables:
			return "", fmt.Errorf("publication %s publishes all tables: the WAL relay needs a publication of %s alone (drop it, or choose another Publication)", publication, table)
		case len(others) > 0:
			return "", fmt.Errorf("publication %s also publishes %s: the WAL relay needs a publication of %s alone (drop those tables from it, or choose another Publication)",
				publication, strings.Join(others, ", "), table)
		case hasTable:
			return schema, nil
		case pubExists:
			return "", fmt.Errorf("publication %s exists but does not publish %s: drop it or choose another Publication", publication, table)
		}
		_, err = db.Exec(ctx, "CREATE PUBLICATION "+pgx.Identifier{publication}.Sanitize()+" FOR TABLE "+table+" WITH (publish = 'insert')")
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" { // created meanwhile by another relay
			continue
		}
		if err != nil {
			return "", fmt.Errorf("create publication %s: %w", publication, err)
		}
		return schema, nil
	}
	return "", fmt.Errorf("create publication %s: it keeps appearing and vanishing", publication)
}

// ensureHandedOverIndexes creates the indexes the hand-over uses, if missing.
func ensureHandedOverIndexes(ctx context.Context, db outbox.DB, schema string) error {
	for name, ddl := range handedOverIndexes {
		var exists bool
		if err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = $2)`,
			schema, name).Scan(&exists); err != nil {
			return fmt.Errorf("look for index %s: %w", name, err)
		}
		if !exists {
			if _, err := db.Exec(ctx, ddl); err != nil {
				return fmt.Errorf("create index %s: %w", name, err)
			}
		}
	}
	return nil
}

// Drop removes the slot and the publication a relay created, and the slot's
// row in outbox_wal_slots. Run it when a
// relay is retired for good (switching back to the polling relay, removing
// the service): a slot nobody reads keeps every WAL segment written since its
// position. It fails while a relay streams from the slot. Missing objects
// are not an error.
func Drop(ctx context.Context, db outbox.DB, slot, publication string) error {
	if _, err := db.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, slot); err != nil {
		return fmt.Errorf("outboxwal drop slot %s: %w", slot, err)
	}
	if _, err := db.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{publication}.Sanitize()); err != nil {
		return fmt.Errorf("outboxwal drop publication %s: %w", publication, err)
	}
	var hasTable bool
	if err := db.QueryRow(ctx, `SELECT to_regclass('outbox_wal_slots') IS NOT NULL`).Scan(&hasTable); err != nil {
		return fmt.Errorf("outboxwal drop slot %s: %w", slot, err)
	}
	if hasTable {
		if _, err := db.Exec(ctx, `DELETE FROM outbox_wal_slots WHERE slot_name = $1`, slot); err != nil {
			return fmt.Errorf("outboxwal drop slot %s: forget its holder: %w", slot, err)
		}
	}
	return nil
}

// SlotStatus describes a replication slot.
type SlotStatus struct {
	// Exists says the slot is there; the other fields are zero when not.
	Exists bool
	// Active says a relay streams from it now.
	Active bool
	// LagBytes is how much WAL the slot retains behind the server's current
	// position: what a relay has yet to read and acknowledge. It grows while
	// no relay runs, and PostgreSQL keeps that WAL on disk.
	LagBytes int64
}

// Slot reads the status of a replication slot; any connection to the server
// can, a relay need not run.
func Slot(ctx context.Context, db outbox.DB, slot string) (SlotStatus, error) {
	var s SlotStatus
	err := db.QueryRow(ctx, `
SELECT true, active,
       greatest(coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), coalesce(confirmed_flush_lsn, restart_lsn)), 0), 0)::bigint
FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&s.Exists, &s.Active, &s.LagBytes)
	if errors.Is(err, pgx.ErrNoRows) {
		return SlotStatus{}, nil
	}
	if err != nil {
		return SlotStatus{}, fmt.Errorf("outboxwal slot %s: %w", slot, err)
	}
	return s, nil
}

// handOverPreexistingSQL hands over to polling the rows that were in the
// outbox when the slot was created: the slot's stream starts after them. It
// runs in the snapshot the slot exported, so it touches exactly those. A row
// blocked with no earlier event of its aggregate left (a row deleted by hand,
// or swept by a relay that did not unblock) is unblocked: the polling relay
// claims only unblocked rows. An earlier row cannot appear later (versions
// only grow), and one in the snapshot keeps the row blocked until the
// polling relay moves it.
const handOverPreexistingSQL = `
UPDATE outbox o SET last_error = 'in the outbox before the WAL relay''s slot was created: handed over to polling',
    blocked = o.blocked AND EXISTS (SELECT 1 FROM outbox p
                                    WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
                                      AND p.aggregate_version < o.aggregate_version)
WHERE o.last_error IS NULL`

// adopt hands over to polling every row in the outbox, for a session that
// cannot tell which of them its slot's stream covers (see session): rows
// the stream delivers as well are found handed over when they are looked
// up (their transactions committed before the session's boundary) and go
// to polling too.
func adopt(ctx context.Context, pool *pgxpool.Pool, f fence) (int64, error) {
	var n int64
	err := fencedTx(ctx, pool, f, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, handOverPreexistingSQL)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("hand over the rows the slot may not cover: %w", err)
	}
	return n, nil
}

func handOverPreexisting(ctx context.Context, pool *pgxpool.Pool, snapshot string) (int64, error) {
	var n int64
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET TRANSACTION SNAPSHOT '"+strings.ReplaceAll(snapshot, "'", "''")+"'"); err != nil {
			return fmt.Errorf("import the slot's snapshot: %w", err)
		}
		tag, err := tx.Exec(ctx, handOverPreexistingSQL)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("hand over the rows older than the slot: %w", err)
	}
	return n, nil
}

// heldSQL lists the aggregates with a row handed over to polling.
const heldSQL = `SELECT DISTINCT aggregate_type, aggregate_id FROM outbox WHERE last_error IS NOT NULL`

func loadHeld(ctx context.Context, db outbox.DB) (map[aggKey]bool, error) {
	rows, err := db.Query(ctx, heldSQL)
	if err != nil {
		return nil, fmt.Errorf("list aggregates handed over: %w", err)
	}
	out := map[aggKey]bool{}
	var k aggKey
	_, err = pgx.ForEachRow(rows, []any{&k.typ, &k.id}, func() error {
		out[k] = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list aggregates handed over: %w", err)
	}
	return out, nil
}

// checkSQL tells, for rows decoded from before this session, which are still
// to publish: gone rows were published (and swept) before, handed-over rows
// belong to polling; in_flight rows had an attempt recorded that got no
// outcome (recordAttemptsSQL).
const checkSQL = `SELECT id, last_error IS NOT NULL, in_flight FROM outbox WHERE id = ANY($1::bigint[])`

// rowCheck is what checkRows found of the rows it looked up.
type rowCheck struct {
	present, handed, inFlight map[int64]bool
}

// checkRows looks up the rows of the batch's events decoded from before this
// session, on the server the session streams from. Their transactions are
// visible (publish checked), so a row not found is gone.
func (r *Relay) checkRows(ctx context.Context, f fence, batch []*event) (rowCheck, error) {
	var ids []int64
	for _, ev := range batch {
		if ev.check {
			ids = append(ids, ev.env.ID)
		}
	}
	var c rowCheck
	err := fencedTx(ctx, r.pool, f, func(tx pgx.Tx) error {
		var err error
		c, err = checkRowsSQL(ctx, tx, ids)
		return err
	})
	return c, err
}

func checkRowsSQL(ctx context.Context, db outbox.DB, ids []int64) (rowCheck, error) {
	rows, err := db.Query(ctx, checkSQL, ids)
	if err != nil {
		return rowCheck{}, fmt.Errorf("check rows: %w", err)
	}
	c := rowCheck{present: map[int64]bool{}, handed: map[int64]bool{}, inFlight: map[int64]bool{}}
	var (
		id    int64
		h, fl bool
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &h, &fl}, func() error {
		c.present[id] = true
		c.handed[id] = h
		c.inFlight[id] = fl
		return nil
	})
	if err != nil {
		return rowCheck{}, fmt.Errorf("check rows: %w", err)
	}
	return c, nil
}

// sweepSQL deletes the rows of confirmed events that it can lock at once,
// and returns their ids. A row it does not return is either gone already
// (published and swept before a restart) or locked: the writer of the
// aggregate's next event holds it FOR KEY SHARE until it commits (see
// outbox's insertSQL), and the relay never waits on a business transaction;
// presentSQL tells them apart, for those few rows only.
const sweepSQL = `
WITH locked AS (
    SELECT id FROM outbox WHERE id = ANY($1::bigint[])
    FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox o USING locked l WHERE o.id = l.id
RETURNING o.id`

// archiveSQL is sweepSQL moving the rows to outbox_published (Config.Archive).
const archiveSQL = `
WITH locked AS (
    SELECT id FROM outbox WHERE id = ANY($1::bigint[])
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM outbox o USING locked l WHERE o.id = l.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type,
              o.payload, o.headers, o.created_at, o.attempts
), archived AS (
    INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                                  payload, headers, created_at, attempts)
    SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at,
           attempts + 1
    FROM moved
    ON CONFLICT (id) DO NOTHING
)
SELECT id FROM moved`

// unblockSweptSQL unblocks the next event of each aggregate whose row the
// sweep deleted, as the polling relay's mark does (outbox's unblockSQL). The
// relay publishes from the stream whether a row is blocked or not, but a row
// left blocked behind nothing is never claimed by a polling relay: the one
// handed-over rows go to, or the one that replaces this relay. It runs as a
// second statement of the sweep's transaction at READ COMMITTED, with a
// snapshot taken after the sweep locked the rows, so it sees the row of every
// writer that held one of them before.
const unblockSweptSQL = `
UPDATE outbox s
SET blocked = false
FROM unnest($1::text[], $2::text[], $3::bigint[]) AS m(aggregate_type, aggregate_id, version)
WHERE s.aggregate_type = m.aggregate_type
  AND s.aggregate_id = m.aggregate_id
  AND s.aggregate_version = m.version + 1
  AND s.blocked
  AND NOT EXISTS (
      SELECT 1 FROM outbox p
      WHERE p.aggregate_type = s.aggregate_type
        AND p.aggregate_id = s.aggregate_id
        AND p.aggregate_version < s.aggregate_version)`

// presentSQL returns which of the rows are still in the outbox.
const presentSQL = `SELECT id FROM outbox WHERE id = ANY($1::bigint[])`

// deadLetterSQL dead-letters events the relay gave up on, as the polling
// relay would: attempts, error, time. The row is its aggregate's head (every
// earlier event was confirmed and swept first), so it is unblocked: once an
// operator retries it, the polling relay's claim finds it.
const deadLetterSQL = `
UPDATE outbox o
SET dead_lettered_at = now(), attempts = f.attempts, last_error = f.err, in_flight = false,
    next_attempt_at = now(),
    blocked = EXISTS (SELECT 1 FROM outbox p
                      WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id
                        AND p.aggregate_version < o.aggregate_version)
FROM unnest($1::bigint[], $2::int[], $3::text[]) AS f(id, attempts, err)
WHERE o.id = f.id AND o.last_error IS NULL`

// parkSQL hands rows over to polling: they wait behind an earlier handed-over
// event of their aggregate, blocked as Enqueue left them, and the polling
// relay unblocks and publishes them in order once that event is published or
// discarded.
//
// A row handed over because its publish failed counts that attempt, so the
// polling relay's MaxAttempts covers both relays' attempts.
const parkSQL = `
UPDATE outbox o SET last_error = f.err, attempts = o.attempts + f.added, in_flight = false
FROM unnest($1::bigint[], $2::text[], $3::int[]) AS f(id, err, added)
WHERE o.id = f.id AND o.last_error IS NULL`

// write sweeps and hands over in one transaction at READ COMMITTED (each
// statement sees what the previous ones did). It returns the events it
// swept, those it could not (locked by a writer), and the hand-overs it
// postponed because an earlier row of their aggregate is among those.
//
// The stream can deliver a transaction before its rows are visible (see
// notVisible): the events of transactions still committing are postponed,
// not swept or handed over by a statement that would not see their rows.
//
// The transaction starts with the fence (fenceSQL): it writes nothing, and
// returns errFenced, once another session holds the slot.
func write(ctx context.Context, pool *pgxpool.Pool, f fence, archive bool, sweep []*event, hand []handover) (swept, skipped []*event, handed, postponed []handover, err error) {
	all := append([]*event(nil), sweep...)
	for _, h := range hand {
		all = append(all, h.ev)
	}
	hidden, err := notVisible(ctx, pool, f, all)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	locked := map[uint32]bool{}
	for _, ev := range hidden {
		locked[ev.tx.xid] = true
	}
	var notYet []*event
	var notYetHand []handover
	if len(locked) > 0 {
		var visible []*event
		for _, ev := range sweep {
			if locked[ev.tx.xid] {
				notYet = append(notYet, ev)
			} else {
				visible = append(visible, ev)
			}
		}
		sweep = visible
		var visibleHand []handover
		for _, h := range hand {
			if locked[h.ev.tx.xid] {
				notYetHand = append(notYetHand, h)
			} else {
				visibleHand = append(visibleHand, h)
			}
		}
		hand = visibleHand
	}
	notYetAggs := map[aggKey]bool{}
	for _, ev := range notYet {
		notYetAggs[ev.key] = true
	}
	defer func() {
		skipped = append(skipped, notYet...)
		postponed = append(postponed, notYetHand...)
	}()
	ids := make([]int64, len(sweep))
	for i, ev := range sweep {
		ids[i] = ev.env.ID
	}
	query := sweepSQL
	if archive {
		query = archiveSQL
	}
	run := func(db outbox.DB) error {
		skippedIDs := map[int64]bool{}
		if len(ids) > 0 {
			rows, err := db.Query(ctx, query, ids)
			if err != nil {
				return fmt.Errorf("sweep confirmed rows: %w", err)
			}
			deleted, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return fmt.Errorf("sweep confirmed rows: %w", err)
			}
			if len(deleted) < len(ids) {
				done := make(map[int64]bool, len(deleted))
				for _, id := range deleted {
					done[id] = true
				}
				var rest []int64
				for _, id := range ids {
					if !done[id] {
						rest = append(rest, id)
					}
				}
				rows, err := db.Query(ctx, presentSQL, rest)
				if err != nil {
					return fmt.Errorf("sweep confirmed rows: %w", err)
				}
				left, err := pgx.CollectRows(rows, pgx.RowTo[int64])
				if err != nil {
					return fmt.Errorf("sweep confirmed rows: %w", err)
				}
				for _, id := range left {
					skippedIDs[id] = true
				}
			}
		}
		swept, skipped = nil, nil
		blockedAggs := maps.Clone(notYetAggs)
		var types, aggIDs []string
		var versions []int64
		for _, ev := range sweep {
			if skippedIDs[ev.env.ID] {
				skipped = append(skipped, ev)
				blockedAggs[ev.key] = true
			} else {
				swept = append(swept, ev)
				types = append(types, ev.env.AggregateType)
				aggIDs = append(aggIDs, ev.env.AggregateID)
				versions = append(versions, ev.env.AggregateVersion)
			}
		}
		if len(swept) > 0 {
			if _, err := db.Exec(ctx, unblockSweptSQL, types, aggIDs, versions); err != nil {
				return fmt.Errorf("unblock the events after the swept rows: %w", err)
			}
		}
		handed, postponed = nil, nil
		var (
			deadIDs, parkIDs   []int64
			deadAtt            []int32
			deadErrs, parkErrs []string
			parkAdded          []int32
		)
		for _, h := range hand {
			if blockedAggs[h.ev.key] {
				postponed = append(postponed, h)
				continue
			}
			handed = append(handed, h)
			if h.dead {
				deadIDs = append(deadIDs, h.ev.env.ID)
				deadAtt = append(deadAtt, int32(h.ev.failures))
				deadErrs = append(deadErrs, errorText(h.err))
			} else {
				parkIDs = append(parkIDs, h.ev.env.ID)
				parkErrs = append(parkErrs, errorText(h.err))
				parkAdded = append(parkAdded, int32(h.added))
			}
		}
		if len(deadIDs) > 0 {
			if _, err := db.Exec(ctx, deadLetterSQL, deadIDs, deadAtt, deadErrs); err != nil {
				return fmt.Errorf("dead-letter events: %w", err)
			}
		}
		if len(parkIDs) > 0 {
			if _, err := db.Exec(ctx, parkSQL, parkIDs, parkErrs, parkAdded); err != nil {
				return fmt.Errorf("hand over events: %w", err)
			}
		}
		return nil
	}
	// One transaction at READ COMMITTED: each statement sees what the
	// previous ones did, and the unblock takes its snapshot after the sweep
	// locked its rows.
	err = fencedTx(ctx, pool, f, func(tx pgx.Tx) error { return run(tx) })
	if err != nil {
		return nil, nil, nil, nil, err
	}
	return swept, skipped, handed, postponed, nil
}

// errorText makes s storable as text: valid UTF-8, no NUL, bounded.
func errorText(s string) string {
	s = strings.ToValidUTF8(s, "?")
	s = strings.ReplaceAll(s, "\x00", "?")
	if len(s) > maxErrorText {
		cut := maxErrorText
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "..."
	}
	return s
}

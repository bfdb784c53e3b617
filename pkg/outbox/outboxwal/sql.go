package outboxwal

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
)

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
// outbox table's schema. The indexes the relay uses on the outbox table are
// package outbox's: outbox.CheckSchema refuses an outdated schema. A publication of that name that publishes anything
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
			if err := checkPublication(ctx, db, publication, schema); err != nil {
				return "", err
			}
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

// checkPublication refuses a publication of the outbox that would stream
// less than every insert whole: one that does not publish inserts, or one
// with a row filter or a column list on the outbox (PostgreSQL 15 and
// later; read through to_jsonb, so the query parses on earlier versions
// too). The relay would stream and publish nothing, or rows it cannot
// decode.
func checkPublication(ctx context.Context, db outbox.DB, publication, schema string) error {
	var (
		inserts, filtered, columns bool
	)
	err := db.QueryRow(ctx, `
SELECT p.pubinsert,
       EXISTS (SELECT 1 FROM pg_publication_tables t
               WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = 'outbox'
                 AND to_jsonb(t) ->> 'rowfilter' IS NOT NULL),
       EXISTS (SELECT 1 FROM pg_publication_rel r
               WHERE r.prpubid = p.oid AND r.prrelid = format('%I.outbox', $2::text)::regclass
                 AND to_jsonb(r) ->> 'prattrs' IS NOT NULL)
FROM pg_publication p WHERE p.pubname = $1`, publication, schema).Scan(&inserts, &filtered, &columns)
	if err != nil {
		return fmt.Errorf("read publication %s: %w", publication, err)
	}
	var wrong []string
	if !inserts {
		wrong = append(wrong, "it does not publish inserts (publish must include 'insert')")
	}
	if filtered {
		wrong = append(wrong, "it has a row filter on the outbox (WHERE)")
	}
	if columns {
		wrong = append(wrong, "it has a column list on the outbox")
	}
	if len(wrong) > 0 {
		return fmt.Errorf("publication %s: %s: the WAL relay needs every insert of the outbox whole (drop it, and a relay makes one, or choose another Publication)",
			publication, strings.Join(wrong, "; "))
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

// preexistingReason is the last_error of the rows in the outbox when the
// slot was made: its stream starts after them.
const preexistingReason = "in the outbox before the WAL relay's slot was created: handed over to polling"

// adoptedReason is the last_error of the rows a session handed over because
// it could not tell whether its slot's stream covers them.
const adoptedReason = "in the outbox when the WAL relay took a slot it cannot vouch for (another server, or a slot no relay used): handed over to polling"

// recordedServerSQL reads the server slot was last known to cover the
// outbox on ("" when none is recorded).
const recordedServerSQL = `SELECT coalesce((SELECT server FROM outbox_wal_slots WHERE slot_name = $1), '')`

// advanceSlotSQL moves slot on to the server's current WAL position,
// skipping its stream up to there (PostgreSQL reads that WAL without
// decoding it for the output plugin).
const advanceSlotSQL = `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`

// recordSlotServerSQL records that slot covers the whole outbox on server:
// the rows its stream lacks there were handed over (see backlog), and a
// session that takes it on that server has nothing to hand over.
const recordSlotServerSQL = `
INSERT INTO outbox_wal_slots (slot_name, server) VALUES ($1, $2)
ON CONFLICT (slot_name) DO UPDATE SET server = excluded.server`

// loadHeld lists the aggregates with a row handed over to polling.
func loadHeld(ctx context.Context, db outbox.DB) (map[aggKey]bool, error) {
	held, err := outboxsql.HandedOverAggregates(ctx, db)
	if err != nil {
		return nil, err
	}
	out := make(map[aggKey]bool, len(held))
	for a := range held {
		out[aggKey{a.Type, a.ID}] = true
	}
	return out, nil
}

// checkRows looks up the rows of the batch's events decoded from before this
// session, on the server the session streams from. Their transactions are
// visible (publish checked), so a row not found is gone: published and
// swept before this session.
func (r *Relay) checkRows(ctx context.Context, f fence, batch []*event) (map[int64]outboxsql.RowState, error) {
	var ids []int64
	for _, ev := range batch {
		if ev.check {
			ids = append(ids, ev.env.ID)
		}
	}
	var found map[int64]outboxsql.RowState
	err := fencedTx(ctx, r.pool, f, func(tx pgx.Tx) error {
		var err error
		found, err = outboxsql.Lookup(ctx, tx, ids)
		return err
	})
	return found, err
}

// writeResult is what one write did with the rows it was given.
type writeResult struct {
	// swept are the confirmed events whose rows left the table (or were
	// gone already); skipped those it could not sweep yet: a writer of the
	// aggregate's next event holds the row, or the event's transaction is
	// not visible yet.
	swept, skipped []*event
	// handed are the hand-overs written; postponed those that wait for an
	// earlier row of their aggregate to be swept.
	handed, postponed []handover
}

// write sweeps confirmed rows and hands rows over to polling, in one
// transaction at READ COMMITTED that starts with the session's fence: it
// writes nothing, and returns errFenced, once another session holds the
// slot.
//
// The stream can deliver a transaction before its rows are visible (see
// notVisible): the events of such transactions are left for the next write,
// as are the hand-overs of any aggregate with a row left unswept, so that a
// row is handed over only once every earlier row of its aggregate is gone
// or handed over itself.
func write(ctx context.Context, pool *pgxpool.Pool, f fence, archive bool, sweep []*event, hand []handover) (writeResult, error) {
	var res writeResult
	all := append([]*event(nil), sweep...)
	for _, h := range hand {
		all = append(all, h.ev)
	}
	hidden, err := notVisible(ctx, pool, f, all)
	if err != nil {
		return writeResult{}, err
	}
	invisible := map[*txn]bool{}
	for _, ev := range hidden {
		invisible[ev.tx] = true
	}
	var visible []*event
	for _, ev := range sweep {
		if invisible[ev.tx] {
			res.skipped = append(res.skipped, ev)
		} else {
			visible = append(visible, ev)
		}
	}
	err = fencedTx(ctx, pool, f, func(tx pgx.Tx) error {
		swept, skipped, err := sweepRows(ctx, tx, visible, archive)
		if err != nil {
			return err
		}
		res.swept, res.skipped = swept, append(skipped, res.skipped...)
		res.handed, res.postponed, err = handOver(ctx, tx, hand, invisible, res.skipped)
		return err
	})
	if err != nil {
		return writeResult{}, err
	}
	return res, nil
}

// sweepRows deletes (or archives) the rows of evs it can lock at once and
// unblocks the next event of their aggregates, as the polling relay's mark
// does, so that a polling relay can claim it later. It returns the events
// whose rows are gone and those a writer holds.
func sweepRows(ctx context.Context, tx pgx.Tx, evs []*event, archive bool) (swept, skipped []*event, err error) {
	if len(evs) == 0 {
		return nil, nil, nil
	}
	ids := make([]int64, len(evs))
	for i, ev := range evs {
		ids[i] = ev.env.ID
	}
	deleted, err := outboxsql.Sweep(ctx, tx, ids, archive)
	if err != nil {
		return nil, nil, err
	}
	held := map[int64]bool{}
	if len(deleted) < len(ids) {
		// Not deleted: gone already (swept before a restart), or locked.
		gone := make(map[int64]bool, len(deleted))
		for _, id := range deleted {
			gone[id] = true
		}
		var rest []int64
		for _, id := range ids {
			if !gone[id] {
				rest = append(rest, id)
			}
		}
		left, err := outboxsql.Present(ctx, tx, rest)
		if err != nil {
			return nil, nil, err
		}
		for _, id := range left {
			held[id] = true
		}
	}
	var heads []outboxsql.Head
	for _, ev := range evs {
		if held[ev.env.ID] {
			skipped = append(skipped, ev)
			continue
		}
		swept = append(swept, ev)
		heads = append(heads, outboxsql.Head{AggregateType: ev.env.AggregateType, AggregateID: ev.env.AggregateID, Version: ev.env.AggregateVersion})
	}
	if len(heads) > 0 {
		if err := outboxsql.UnblockNext(ctx, tx, heads); err != nil {
			return nil, nil, err
		}
	}
	return swept, skipped, nil
}

// handOver writes the hand-overs of hand, except those of an invisible
// transaction and those of an aggregate with a row left unswept, which it
// returns as postponed.
func handOver(ctx context.Context, tx pgx.Tx, hand []handover, invisible map[*txn]bool, unswept []*event) (handed, postponed []handover, err error) {
	waiting := map[aggKey]bool{}
	for _, ev := range unswept {
		waiting[ev.key] = true
	}
	var rows []outboxsql.Handing
	for _, h := range hand {
		if invisible[h.ev.tx] || waiting[h.ev.key] {
			postponed = append(postponed, h)
			continue
		}
		handed = append(handed, h)
		rows = append(rows, outboxsql.Handing{
			ID: h.ev.env.ID, Reason: h.err, Dead: h.dead,
			Attempts: int32(h.ev.failures), Added: int32(h.added),
		})
	}
	if len(rows) > 0 {
		if err := outboxsql.HandOver(ctx, tx, rows); err != nil {
			return nil, nil, err
		}
	}
	return handed, postponed, nil
}

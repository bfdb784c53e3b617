package outboxwal

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// Schema is the table the relay keeps beside the outbox: one row per slot,
// with the session that holds the slot (its epoch) and how far sessions have
// dispatched events to the publisher. Run and Prepare create it when it is
// missing; it is idempotent, so it can also go into a migration tool as is.
//
//   - epoch is bumped by every session that takes the slot, in a statement
//     that waits for the writes of the session before it. Every later write of
//     a session (a sweep, a dead letter, a hand-over, a record of attempts)
//     and every batch it starts is conditional on its epoch being the
//     current one: a session whose replication connection was cut while its
//     process still runs is fenced off as soon as its successor has the slot.
//   - dispatched is at or past the commit position of every event a session
//     handed to the publisher, written before the batch is sent. After a
//     crash, the events at or below it are the ones a session may have had in
//     flight: their attempts are recorded in the outbox row (attempts,
//     in_flight) before they are published again, so an event that crashes
//     every relay that publishes it is dead-lettered after MaxAttempts, and
//     one that was in flight at two crashes in a row is published alone.
const Schema = `
CREATE TABLE IF NOT EXISTS outbox_wal_slots (
    slot_name  text        PRIMARY KEY,
    epoch      bigint      NOT NULL DEFAULT 0,
    dispatched pg_lsn      NOT NULL DEFAULT '0/0',
    holder     text        NOT NULL DEFAULT '',
    taken_at   timestamptz
);`

// errFenced means another session took the slot: this one must stop at once
// and write nothing more.
var errFenced = errors.New("outboxwal: another relay took the slot (this session's epoch is no longer current)")

// ensureSlotsTable creates outbox_wal_slots when the search_path has none
// (it is created where the outbox was: the first schema of the search_path).
func ensureSlotsTable(ctx context.Context, db outbox.DB) error {
	var exists bool
	if err := db.QueryRow(ctx, `SELECT to_regclass('outbox_wal_slots') IS NOT NULL`).Scan(&exists); err != nil {
		return fmt.Errorf("look for table outbox_wal_slots: %w", err)
	}
	if exists {
		return nil
	}
	_, err := db.Exec(ctx, Schema)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P07" || pgErr.Code == "23505") { // created meanwhile by another relay
		return nil
	}
	if err != nil {
		return fmt.Errorf("create table outbox_wal_slots: %w", err)
	}
	return nil
}

// holderName says which process holds a slot, for operators reading
// outbox_wal_slots.
func holderName() string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown host"
	}
	return host + " pid " + strconv.Itoa(os.Getpid())
}

// lockSlotSQL locks the slot's row FOR UPDATE before bumpEpochSQL bumps its
// epoch (an UPDATE alone takes FOR NO KEY UPDATE, which a write holding the
// row FOR KEY SHARE does not make wait): it waits for a write of the previous
// session still committing, so every write of the previous session is either
// visible to this session's first reads or never happens.
const lockSlotSQL = `SELECT dispatched::text FROM outbox_wal_slots WHERE slot_name = $1 FOR UPDATE`

const bumpEpochSQL = `
UPDATE outbox_wal_slots SET epoch = epoch + 1, holder = $2, taken_at = now()
WHERE slot_name = $1 RETURNING epoch`

// takeSlot makes this session the slot's holder and returns its epoch and the
// dispatched position sessions before it reached.
func takeSlot(ctx context.Context, pool *pgxpool.Pool, slot string) (epoch int64, dispatched uint64, err error) {
	err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO outbox_wal_slots (slot_name) VALUES ($1) ON CONFLICT DO NOTHING`, slot); err != nil {
			return err
		}
		var text string
		if err := tx.QueryRow(ctx, lockSlotSQL, slot).Scan(&text); err != nil {
			return err
		}
		lsn, err := pglogrepl.ParseLSN(text)
		if err != nil {
			return fmt.Errorf("dispatched position %q: %w", text, err)
		}
		dispatched = uint64(lsn)
		return tx.QueryRow(ctx, bumpEpochSQL, slot, holderName()).Scan(&epoch)
	})
	if err != nil {
		return 0, 0, fmt.Errorf("take slot %s: %w", slot, err)
	}
	return epoch, dispatched, nil
}

// markDispatchedSQL records that events up to a commit position are handed to
// the publisher, if the session still holds the slot. It locks the row FOR NO
// KEY UPDATE, which a sweep's KEY SHARE does not wait for.
const markDispatchedSQL = `
UPDATE outbox_wal_slots SET dispatched = greatest(dispatched, $3::text::pg_lsn)
WHERE slot_name = $1 AND epoch = $2`

// markDispatched runs markDispatchedSQL; errFenced when another session holds
// the slot.
func markDispatched(ctx context.Context, db outbox.DB, slot string, epoch int64, lsn uint64) error {
	tag, err := db.Exec(ctx, markDispatchedSQL, slot, epoch, pglogrepl.LSN(lsn).String())
	if err != nil {
		return fmt.Errorf("record the dispatched position: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return errFenced
	}
	return nil
}

// fenceSQL, first in a write transaction, holds the slot's row FOR KEY SHARE
// until the transaction ends, if this session still holds the slot: the next
// session's lockSlotSQL waits for it, and a write that starts after that
// finds no row.
const fenceSQL = `SELECT 1 FROM outbox_wal_slots WHERE slot_name = $1 AND epoch = $2 FOR KEY SHARE`

// fencedTx runs fn in a transaction at READ COMMITTED that starts with
// fenceSQL: it returns errFenced, and writes nothing, once another session
// holds the slot.
func fencedTx(ctx context.Context, pool *pgxpool.Pool, slot string, epoch int64, fn func(pgx.Tx) error) error {
	return pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var one int
		err := tx.QueryRow(ctx, fenceSQL, slot, epoch).Scan(&one)
		if errors.Is(err, pgx.ErrNoRows) {
			return errFenced
		}
		if err != nil {
			return fmt.Errorf("check the slot is still held: %w", err)
		}
		return fn(tx)
	})
}

// recordAttemptsSQL records that an attempt of each row begins: attempts + 1,
// in_flight. It returns the new attempts and whether the row was in flight
// already (an attempt recorded before had no outcome: its relay stopped). Rows
// handed over to polling (last_error set) are not touched.
const recordAttemptsSQL = `
WITH prev AS (
    SELECT id, in_flight FROM outbox
    WHERE id = ANY($1::bigint[]) AND last_error IS NULL
    FOR NO KEY UPDATE
)
UPDATE outbox o SET attempts = o.attempts + 1, in_flight = true
FROM prev WHERE o.id = prev.id
RETURNING o.id, o.attempts, prev.in_flight`

// unrecordSQL takes back recorded attempts that the broker confirmed: the
// row's attempts count the recorded attempts that got no confirm.
const unrecordSQL = `
UPDATE outbox SET attempts = greatest(attempts - 1, 0), in_flight = false
WHERE id = ANY($1::bigint[]) AND in_flight AND last_error IS NULL`

// recorded is what recordAttempts found for a row.
type recorded struct {
	attempts    int
	wasInFlight bool
}

func recordAttempts(ctx context.Context, pool *pgxpool.Pool, slot string, epoch int64, ids []int64) (map[int64]recorded, error) {
	out := make(map[int64]recorded, len(ids))
	err := fencedTx(ctx, pool, slot, epoch, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, recordAttemptsSQL, ids)
		if err != nil {
			return err
		}
		var (
			id  int64
			rec recorded
		)
		_, err = pgx.ForEachRow(rows, []any{&id, &rec.attempts, &rec.wasInFlight}, func() error {
			out[id] = rec
			return nil
		})
		return err
	})
	if errors.Is(err, errFenced) {
		return nil, err
	}
	if err != nil {
		return nil, fmt.Errorf("record attempts: %w", err)
	}
	return out, nil
}

// unrecordAttempts runs unrecordSQL, if the session still holds the slot.
func unrecordAttempts(ctx context.Context, pool *pgxpool.Pool, slot string, epoch int64, ids []int64) error {
	err := fencedTx(ctx, pool, slot, epoch, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, unrecordSQL, ids)
		return err
	})
	if err != nil && !errors.Is(err, errFenced) {
		return fmt.Errorf("take back confirmed attempts: %w", err)
	}
	return err
}

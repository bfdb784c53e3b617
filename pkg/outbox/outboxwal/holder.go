package outboxwal

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
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
//   - server is the server on which the slot was last known to cover the
//     whole outbox: the one it was made on (by Prepare or a session), or
//     where a session handed over the rows it could not vouch for: its
//     system identifier and timeline. A session that finds another one there (a
//     promoted standby, a restored or different server behind the same
//     address) cannot trust the slot to cover what the outbox holds, and
//     hands the outbox's rows over to polling before it streams.
const Schema = `
CREATE TABLE IF NOT EXISTS outbox_wal_slots (
    slot_name  text        PRIMARY KEY,
    epoch      bigint      NOT NULL DEFAULT 0,
    dispatched pg_lsn      NOT NULL DEFAULT '0/0',
    holder     text        NOT NULL DEFAULT '',
    taken_at   timestamptz,
    server     text
);`

// errFenced means another session took the slot, or the pool now reaches
// another server than the one the session streams from: the session must
// stop at once and write nothing more.
var errFenced = errors.New("outboxwal: this session no longer holds the slot (another relay took it, or the database is another server now)")

// ensureSlotsTable creates outbox_wal_slots when the search_path has none,
// or adds the columns it lacks (it is created where the outbox was: the
// first schema of the search_path).
func ensureSlotsTable(ctx context.Context, db outbox.DB) error {
	var exists bool
	if err := db.QueryRow(ctx, `
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('outbox_wal_slots') AND attname = 'server' AND NOT attisdropped)`).Scan(&exists); err != nil {
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

// serverSQL names the server a statement runs on: its system identifier
// (shared by a primary and its physical standbys) and the timeline it writes
// (a promoted standby starts a new one). It fails on a standby, where the
// relay has nothing to do. IDENTIFY_SYSTEM gives the same two on the
// replication connection (serverName).
const serverSQL = `((SELECT system_identifier::text FROM pg_control_system()) || '/' ||
    ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int)`

// serverName is what serverSQL returns for the server IDENTIFY_SYSTEM
// described.
func serverName(id pglogrepl.IdentifySystemResult) string {
	return id.SystemID + "/" + strconv.Itoa(int(id.Timeline))
}

// errOtherServer means a pool connection reached another server than the
// replication connection: the session would read and write where it does
// not stream from.
var errOtherServer = errors.New("outboxwal: the pool's connection reaches another server than the replication connection (a switchover in progress?)")

// onServer returns errOtherServer, and closes c (the pool connects anew),
// unless c reaches server.
func onServer(ctx context.Context, c *pgxpool.Conn, server string) error {
	var here string
	if err := c.QueryRow(ctx, "SELECT "+serverSQL).Scan(&here); err != nil {
		return fmt.Errorf("identify the server: %w", err)
	}
	if here != server {
		_ = c.Conn().Close(ctx)
		return fmt.Errorf("%w: pool on %s, replication on %s", errOtherServer, here, server)
	}
	return nil
}

// lockSlotSQL locks the slot's row FOR UPDATE before bumpEpochSQL bumps its
// epoch (an UPDATE alone takes FOR NO KEY UPDATE, which a write holding the
// row FOR KEY SHARE does not make wait): it waits for a write of the previous
// session still committing, so every write of the previous session is either
// visible to this session's first reads or never happens.
const lockSlotSQL = `SELECT dispatched::text, coalesce(server, '')
FROM outbox_wal_slots WHERE slot_name = $1 FOR UPDATE`

// bumpEpochSQL does not record the session's server: a session records it
// once the rows the slot may not cover on it are handed over (see backlog).
const bumpEpochSQL = `
UPDATE outbox_wal_slots SET epoch = epoch + 1, holder = $2, taken_at = now()
WHERE slot_name = $1 RETURNING epoch`

// taken is what a session finds when it takes the slot.
type taken struct {
	epoch int64
	// dispatched is the position the sessions before it dispatched up to.
	dispatched uint64
	// previous is the server the last session streamed from ("" if none
	// did).
	previous string
}

// Limits of the relay's own transactions, set at their start (SET LOCAL):
//   - idle_in_transaction_session_timeout: a relay whose host lost the
//     network in the middle of a transaction would hold the slot's row (and
//     the rows it touched) until TCP gives up on the connection, hours later;
//     the server ends such a session instead, and with it the transaction.
//   - lock_timeout, for the takeover: it waits for the previous session's
//     writes to commit; a session that stopped answering is reported, not
//     waited for until the statement's deadline.
const (
	idleInTransactionTimeout = "10s"
	takeoverLockTimeout      = "2s"
)

// takeSlot makes this session, streaming from server, the slot's holder. It
// returns errOtherServer when the pool's connection is on another server. A
// transaction that holds the slot's row and does not end within
// takeoverLockTimeout is reported in the error with its backend.
func takeSlot(ctx context.Context, pool *pgxpool.Pool, slot, server string) (taken, error) {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return taken{}, fmt.Errorf("take slot %s: %w", slot, err)
	}
	defer c.Release()
	if err := onServer(ctx, c, server); err != nil {
		return taken{}, fmt.Errorf("take slot %s: %w", slot, err)
	}
	var t taken
	err = pgx.BeginTxFunc(ctx, c, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $2, true)`,
			takeoverLockTimeout, idleInTransactionTimeout); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO outbox_wal_slots (slot_name) VALUES ($1) ON CONFLICT DO NOTHING`, slot); err != nil {
			return err
		}
		var text string
		if err := tx.QueryRow(ctx, lockSlotSQL, slot).Scan(&text, &t.previous); err != nil {
			return err
		}
		lsn, err := pglogrepl.ParseLSN(text)
		if err != nil {
			return fmt.Errorf("dispatched position %q: %w", text, err)
		}
		t.dispatched = uint64(lsn)
		return tx.QueryRow(ctx, bumpEpochSQL, slot, holderName()).Scan(&t.epoch)
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		return taken{}, fmt.Errorf("take slot %s: %s", slot, blockers(ctx, pool))
	}
	if err != nil {
		return taken{}, fmt.Errorf("take slot %s: %w", slot, err)
	}
	return t, nil
}

// blockersSQL lists the sessions in a transaction that locked rows of
// outbox_wal_slots: every write of a relay's session does (fenceSQL).
const blockersSQL = `
SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), 'local'), coalesce(a.state, ''),
       coalesce(date_trunc('second', now() - a.state_change)::text, '')
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.relation = to_regclass('outbox_wal_slots') AND l.granted
  AND l.pid <> pg_backend_pid()
ORDER BY a.xact_start`

// blockers says which sessions hold the slot's row, for an operator.
func blockers(ctx context.Context, db outbox.DB) string {
	const what = "the slot's row stayed locked by the previous session's transaction"
	rows, err := db.Query(ctx, blockersSQL)
	if err != nil {
		return what + " (could not list the sessions: " + err.Error() + ")"
	}
	var list []string
	var (
		pid                    int32
		app, host, state, sinc string
	)
	_, err = pgx.ForEachRow(rows, []any{&pid, &app, &host, &state, &sinc}, func() error {
		list = append(list, fmt.Sprintf("backend pid %d (application_name %q, client %s, %s for %s)", pid, app, host, state, sinc))
		return nil
	})
	if err != nil || len(list) == 0 {
		return what + " (it ended meanwhile)"
	}
	return what + ": " + strings.Join(list, "; ") + "; a relay's session ends itself after " + idleInTransactionTimeout +
		" idle in a transaction, or end it with pg_terminate_backend(pid)"
}

// markDispatchedSQL records that events up to a commit position are handed to
// the publisher, if the session still holds the slot, on the server it
// streams from. It locks the row FOR NO KEY UPDATE, which a sweep's KEY
// SHARE does not wait for.
const markDispatchedSQL = `
UPDATE outbox_wal_slots SET dispatched = greatest(dispatched, $4::text::pg_lsn)
WHERE slot_name = $1 AND epoch = $2 AND ` + serverSQL + ` = $3`

// fence is a session's hold on the slot: the epoch it took, on the server
// it streams from. Every write of the session is conditional on both.
type fence struct {
	slot   string
	epoch  int64
	server string
}

// markDispatched runs markDispatchedSQL; errFenced when another session holds
// the slot, or the statement ran on another server.
func markDispatched(ctx context.Context, db outbox.DB, f fence, lsn uint64) error {
	tag, err := db.Exec(ctx, markDispatchedSQL, f.slot, f.epoch, f.server, pglogrepl.LSN(lsn).String())
	if err != nil {
		return fmt.Errorf("record the dispatched position: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return errFenced
	}
	return nil
}

// fenceSQL, first in a transaction, holds the slot's row FOR KEY SHARE
// until the transaction ends, if this session still holds the slot and the
// transaction runs on the server the session streams from: the next
// session's lockSlotSQL waits for it, and a transaction that starts after
// that finds no row.
//
// It also sets the transaction's idle_in_transaction_session_timeout.
const fenceSQL = `SELECT set_config('idle_in_transaction_session_timeout', '` + idleInTransactionTimeout + `', true)
FROM outbox_wal_slots WHERE slot_name = $1 AND epoch = $2 AND ` + serverSQL + ` = $3 FOR KEY SHARE`

// fencedTx runs fn in a transaction at READ COMMITTED that starts with
// fenceSQL: it returns errFenced, and runs nothing, once another session
// holds the slot or when the pool's connection reaches another server.
func fencedTx(ctx context.Context, pool *pgxpool.Pool, f fence, fn func(pgx.Tx) error) error {
	return pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		var set string
		err := tx.QueryRow(ctx, fenceSQL, f.slot, f.epoch, f.server).Scan(&set)
		if errors.Is(err, pgx.ErrNoRows) {
			return errFenced
		}
		if err != nil {
			return fmt.Errorf("check the slot is still held: %w", err)
		}
		return fn(tx)
	})
}

// recordAttempts records, if the session still holds the slot, that an
// attempt of each row begins (outboxsql.RecordAttempts).
func recordAttempts(ctx context.Context, pool *pgxpool.Pool, f fence, ids []int64) (map[int64]outboxsql.Attempt, error) {
	var out map[int64]outboxsql.Attempt
	err := fencedTx(ctx, pool, f, func(tx pgx.Tx) error {
		var err error
		out, err = outboxsql.RecordAttempts(ctx, tx, ids)
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// unrecordAttempts takes back, if the session still holds the slot, recorded
// attempts the broker confirmed (outboxsql.UnrecordAttempts).
func unrecordAttempts(ctx context.Context, pool *pgxpool.Pool, f fence, ids []int64) error {
	return fencedTx(ctx, pool, f, func(tx pgx.Tx) error { return outboxsql.UnrecordAttempts(ctx, tx, ids) })
}

package outboxbackfill

// schemaSQL creates the checkpoint table, which this package owns: one row
// per backfill (Config.Name), with its selection, its upper bound (Until, on
// the events' created_at), when the outbox had nothing of the selection left
// to archive (settled_at, the bound on published_at), how many events it
// covers and has replayed, and the last one checkpointed.
const schemaSQL = `
CREATE TABLE IF NOT EXISTS outbox_backfill (
    name              text        PRIMARY KEY,
    selection         text        NOT NULL,
    until_at          timestamptz NOT NULL,
    settled_at        timestamptz,
    total             bigint,
    replayed          bigint      NOT NULL DEFAULT 0,
    aggregate_type    text        NOT NULL DEFAULT '',
    aggregate_id      text        NOT NULL DEFAULT '',
    aggregate_version bigint      NOT NULL DEFAULT 0,
    started_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz
)`

// insertSQL makes the checkpoint $1 unless it exists: selection $2, Until
// $3, or the database's clock.
const insertSQL = `
INSERT INTO outbox_backfill (name, selection, until_at)
VALUES ($1, $2, coalesce($3::timestamptz, clock_timestamp()))
ON CONFLICT (name) DO NOTHING`

const readSQL = `
SELECT selection, until_at, settled_at, total, replayed, aggregate_type, aggregate_id, aggregate_version, finished_at
FROM outbox_backfill WHERE name = $1`

const settledSQL = `UPDATE outbox_backfill SET settled_at = $2, total = $3, updated_at = now() WHERE name = $1`

const checkpointSQL = `
UPDATE outbox_backfill
SET aggregate_type = $2, aggregate_id = $3, aggregate_version = $4, replayed = replayed + $5, updated_at = now()
WHERE name = $1`

const finishSQL = `UPDATE outbox_backfill SET finished_at = now(), updated_at = now() WHERE name = $1`

-- Schema of pkg/outbox. Migrate applies it; it is idempotent, so it can also be
-- copied into a migration tool as is.
--
-- Three tables keep the hot path small:
--   outbox             rows not yet published: pending, in flight, or dead-lettered.
--                      The relay only ever reads this table, so its size is the
--                      backlog, never the history.
--   outbox_published   rows whose publish the broker confirmed, kept for audit and
--                      purged after a retention period.
--   outbox_aggregates  the last version handed out per aggregate. The upsert that
--                      bumps it locks the aggregate's row until commit, which
--                      serialises writers of one aggregate and keeps versions
--                      gapless even after old rows are purged.

CREATE TABLE IF NOT EXISTS outbox (
    id                bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    payload           jsonb       NOT NULL,
    headers           jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at        timestamptz NOT NULL DEFAULT now(),
    attempts          integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_error        text,
    dead_lettered_at  timestamptz
);

-- Every published row leaves this table, so dead tuples pile up at the rate of
-- publishing. Vacuum it after a fixed number of changes rather than a fraction of
-- its (small) size, so dead index entries never accumulate in front of the claim.
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 5000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 5000
);

-- One version per aggregate; also the index the relay uses to find an aggregate's
-- oldest unpublished event.
CREATE UNIQUE INDEX IF NOT EXISTS outbox_aggregate_version
    ON outbox (aggregate_type, aggregate_id, aggregate_version);

-- The claim's entry point: rows due for an attempt, dead letters excluded.
CREATE INDEX IF NOT EXISTS outbox_due
    ON outbox (next_attempt_at, id) WHERE dead_lettered_at IS NULL;

CREATE TABLE IF NOT EXISTS outbox_published (
    id                bigint      PRIMARY KEY,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    payload           jsonb       NOT NULL,
    headers           jsonb       NOT NULL,
    created_at        timestamptz NOT NULL,
    attempts          integer     NOT NULL,
    published_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS outbox_published_published_at
    ON outbox_published (published_at);

CREATE TABLE IF NOT EXISTS outbox_aggregates (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    version        bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- Schema of pkg/outbox, version 1: the first step of the migrations list in
-- migrate.go. Schema() is every step's SQL, then the version marker.
--
-- Every statement is idempotent, so the SQL can go into a migration tool as
-- is, and run again. On a live database, though, running it as is takes
-- locks even when it changes nothing: ADD COLUMN IF NOT EXISTS takes ACCESS
-- EXCLUSIVE on the table and CREATE INDEX IF NOT EXISTS takes SHARE, and each
-- queues every reader and writer of the table behind any open transaction
-- that touched it. Migrate applies the same statements without that: it
-- reads the catalog first and runs only what is missing, takes each table
-- lock with a short lock_timeout (retrying with backoff, and logging who
-- holds the lock), and builds an index on an existing table CONCURRENTLY.
--
-- Migrate parses each step, so each statement ends with a semicolon at the
-- end of a line, and is one of: CREATE TABLE IF NOT EXISTS, ALTER TABLE ...
-- ADD COLUMN IF NOT EXISTS, ALTER TABLE ... SET (...), CREATE [UNIQUE] INDEX
-- IF NOT EXISTS, DROP INDEX IF EXISTS (Migrate drops concurrently).
--
-- Three tables keep the hot path small:
--   outbox             rows not yet published: pending, in flight, or dead-lettered.
--                      The relay only ever reads this table, so its size is the
--                      backlog, never the history.
--   outbox_published   rows whose publish the broker confirmed, kept for audit and
--                      purged after a retention period.
--   outbox_aggregates  per aggregate, the last version handed out. The upsert that
--                      bumps it locks the aggregate's row until commit, which
--                      serialises writers of one aggregate and keeps versions gapless
--                      even after old rows are purged. Never purge this table:
--                      an aggregate whose row is gone starts again at version 1.
--
-- A row is "blocked" while an earlier event of its aggregate is still in outbox.
-- Only unblocked rows are in the claim's index, so a long queue behind one
-- aggregate (in flight, backing off or dead-lettered) costs the claim nothing:
--   * Enqueue, at READ COMMITTED, holding the aggregate's lock, looks for the
--     previous version in outbox in a statement of its own (so it sees every
--     writer that committed before it got the lock) and, if it is there, locks
--     it FOR KEY SHARE and inserts its row blocked;
--   * the relay moves a published row to outbox_published only if it can lock
--     the row (FOR UPDATE SKIP LOCKED, which a writer's KEY SHARE excludes),
--     then unblocks version + 1 in a later statement of the same transaction.
-- Either the writer sees the row gone (and inserts its row unblocked), or the
-- relay cannot move that row before the writer commits, and then sees the
-- writer's row: a row never stays blocked behind nothing. (An event deleted
-- by hand does leave its successor blocked: remove events with
-- Admin.Discard.) Only the writer of the very next version ever holds that
-- lock, so a relay is never kept waiting by a queue of writers.
-- At REPEATABLE READ and SERIALIZABLE, Enqueue's snapshot may be older than the
-- relay's last move, so it inserts its row unblocked; the claim's head check
-- keeps the order, and such rows cost the claim a little until their turn.

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
    -- The lease of a claim: the row is due at next_attempt_at and, once
    -- claimed, not before this. No index holds it, so the claim's update
    -- of a row changes no indexed column and can be HOT (no new index
    -- entries); an outcome written for the row ends it. Never NULL, so
    -- the claim's new version of the row is no larger than the old one.
    leased_until      timestamptz NOT NULL DEFAULT '-infinity',
    last_error        text,
    dead_lettered_at  timestamptz,
    blocked           boolean     NOT NULL DEFAULT false,
    -- True from a claim until the claim's outcome is written. A due row
    -- still in flight is one whose relay stopped while publishing it (crash,
    -- kill, out of memory): the claim dead-letters it if it reached the
    -- relay's MaxAttempts, and otherwise hands it out again (see suspect).
    in_flight         boolean     NOT NULL DEFAULT false,
    -- The row may be what stops its relays or what the broker refuses, so
    -- the claim hands it out alone: it was in flight when its relay stopped
    -- at two claims in a row, or in a batch the broker refused without
    -- saying which message it refused. An outcome written for it clears it.
    suspect           boolean     NOT NULL DEFAULT false,
    -- A relay that reads the write-ahead log (package outboxwal) handed the
    -- row over to polling: its publish failed, it was dead-lettered, it
    -- waits behind such a row of its aggregate, or the relay's slot does not
    -- cover it. Only the polling relay the WAL relay runs claims such rows,
    -- and the WAL relay leaves them alone. Set until the row leaves.
    handed_over       boolean     NOT NULL DEFAULT false
);

-- Every published row leaves this table, so dead tuples pile up at the rate of
-- publishing. Vacuum it after a fixed number of changes rather than a fraction of
-- its (small) size, so dead index entries never accumulate in front of the claim.
-- Pages are filled at insert (fillfactor 100). At a steady rate the claim's
-- update is still HOT nearly always: when the claim reads a page, PostgreSQL
-- prunes it of the rows already moved out, which leaves room for the new
-- version.
-- A lower fillfactor would make the claims of a backlog HOT too (its pages,
-- written packed, have no room), but a writer leaves a page once it is
-- filled to the fillfactor and comes back only after a vacuum: between
-- vacuums the table grows several times faster (at 50, 3.3 times its rows'
-- packed size, against 0.5 to 0.6 at 100), and a claim that scans it reads
-- every page.
-- These are defaults: Migrate sets only the options a table lacks, so values a
-- DBA tunes later stay (this statement run as is sets them all back).
ALTER TABLE outbox SET (
    fillfactor = 100,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 5000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 5000
);

-- One version per aggregate; also the index the relay uses to unblock an
-- aggregate's next event and to check that a claimed row is its aggregate's oldest.
CREATE UNIQUE INDEX IF NOT EXISTS outbox_aggregate_version
    ON outbox (aggregate_type, aggregate_id, aggregate_version);

-- The claim's entry point: the head event of each aggregate, in due order. Blocked
-- rows and dead letters are not in it, so its size is the number of aggregates
-- with work, and the claim reads about as many entries as it returns, plus
-- the rows in flight: a lease leaves a row's entry where it was.
CREATE INDEX IF NOT EXISTS outbox_due
    ON outbox (next_attempt_at, id) WHERE dead_lettered_at IS NULL AND NOT blocked;

-- The operator's list of dead letters. Dead letters are rare, so it stays tiny.
CREATE INDEX IF NOT EXISTS outbox_dead_lettered
    ON outbox (id) WHERE dead_lettered_at IS NOT NULL;

-- The hand-over relay's claim: handed-over rows in due order. Empty while
-- nothing fails with the WAL relay, and always with the polling relay.
CREATE INDEX IF NOT EXISTS outbox_handover_due
    ON outbox (next_attempt_at, id) WHERE handed_over AND dead_lettered_at IS NULL AND NOT blocked;

-- The WAL relay's list of aggregates held by polling.
CREATE INDEX IF NOT EXISTS outbox_handover_aggregates
    ON outbox (aggregate_type, aggregate_id) WHERE handed_over;

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

-- Admin.History's way to one aggregate's published events, most recent
-- first; without it each call reads the whole table. Every published event
-- pays for it: the relay's move into this table writes one more index entry.
CREATE INDEX IF NOT EXISTS outbox_published_aggregate_version
    ON outbox_published (aggregate_type, aggregate_id, aggregate_version);

CREATE TABLE IF NOT EXISTS outbox_aggregates (
    aggregate_type    text   NOT NULL,
    aggregate_id      text   NOT NULL,
    version           bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- Writers update every aggregate row they touch, without
-- changing an indexed column: leave room on each page so those updates stay HOT
-- (no new index entry, no index bloat on this ever-growing table).
ALTER TABLE outbox_aggregates SET (fillfactor = 80);

-- Events an operator discarded with Admin.Discard: dead letters that could never
-- be published, with what they held, when and why. Discarding takes the event
-- out of outbox and unblocks its aggregate's next event, under the same locks
-- as publishing it would. Discards are rare: nothing purges this table.
CREATE TABLE IF NOT EXISTS outbox_discarded (
    id                bigint      PRIMARY KEY,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    payload           jsonb       NOT NULL,
    headers           jsonb       NOT NULL,
    created_at        timestamptz NOT NULL,
    attempts          integer     NOT NULL,
    last_error        text,
    dead_lettered_at  timestamptz NOT NULL,
    discarded_at      timestamptz NOT NULL DEFAULT now(),
    reason            text        NOT NULL
);

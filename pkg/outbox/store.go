package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// claimSQL leases up to $1 due head events for $2 milliseconds, in one short
// transaction of its own.
//
// A head event is the oldest event of its aggregate still in the outbox. Rows
// behind it are "blocked" and are not in the outbox_due index at all, so the
// scan reads about as many entries as it returns however long the queue behind
// an in-flight, failing or dead-lettered event. The NOT EXISTS re-checks the
// head rule on the few rows the scan returns; it is what ordering rests on even
// if a row was inserted without Enqueue.
//
// The lease (next_attempt_at in the future) takes the row out of the due range
// once this statement commits, so no row lock is held while publishing, and a
// relay that dies with the row is replaced when the lease ends. attempts is
// incremented here, so a crash mid-publish counts as an attempt; the relay's
// later updates use it as a fencing token.
//
// There is no id cursor: ids are allocated at insert, not at commit, so a
// cursor would skip rows that commit late. A row is pending until it is moved.
const claimSQL = `
WITH due AS (
    SELECT o.id
    FROM outbox o
    WHERE o.dead_lettered_at IS NULL
      AND NOT o.blocked
      AND o.next_attempt_at <= now()
      AND NOT EXISTS (
          SELECT 1 FROM outbox p
          WHERE p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.aggregate_version < o.aggregate_version)
    ORDER BY o.next_attempt_at, o.id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox o
SET attempts = o.attempts + 1,
    next_attempt_at = now() + $2::bigint * interval '1 millisecond'
WHERE o.id = ANY(ARRAY(SELECT id FROM due))
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type,
          o.payload, o.headers, o.created_at, o.attempts`

func claim(ctx context.Context, db DB, limit int, lease time.Duration) ([]Envelope, error) {
	rows, err := db.Query(ctx, claimSQL, limit, lease.Milliseconds())
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	envs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Envelope, error) {
		var e Envelope
		err := r.Scan(&e.ID, &e.AggregateType, &e.AggregateID, &e.AggregateVersion, &e.EventType,
			&e.Payload, &e.Headers, &e.CreatedAt, &e.Attempt)
		if e.Headers == nil {
			e.Headers = map[string]string{}
		}
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("claim outbox batch: %w", err)
	}
	return envs, nil
}

// lockAggregatesSQL is the first statement of a mark: it locks the aggregates
// of the confirmed rows, skipping those a writer holds right now, and advances
// their published_version. It returns the aggregates it locked.
//
// Holding the lock is what makes the unblocking in moveSQL complete: a writer of
// the aggregate either committed before the lock was granted (its row is visible
// to moveSQL, which runs next with a fresh snapshot, and gets unblocked) or waits
// for this transaction and then reads the new published_version (and inserts its
// row unblocked). Skipping instead of waiting means a relay never waits on a
// business transaction: a skipped row is marked again a moment later.
const lockAggregatesSQL = `
WITH locked AS (
    SELECT a.aggregate_type, a.aggregate_id, i.version
    FROM unnest($1::text[], $2::text[], $3::bigint[]) AS i(aggregate_type, aggregate_id, version)
    CROSS JOIN LATERAL (
        SELECT a.aggregate_type, a.aggregate_id
        FROM outbox_aggregates a
        WHERE a.aggregate_type = i.aggregate_type AND a.aggregate_id = i.aggregate_id
        FOR UPDATE SKIP LOCKED) a
), advanced AS (
    UPDATE outbox_aggregates a
    SET published_version = l.version
    FROM locked l
    WHERE a.aggregate_type = l.aggregate_type AND a.aggregate_id = l.aggregate_id
      AND a.published_version < l.version
)
SELECT aggregate_type, aggregate_id FROM locked`

// moveSQL is the second statement of a mark, in the same transaction: it moves
// the confirmed rows whose aggregate is now published up to them into
// outbox_published, and unblocks the next event of each.
const moveSQL = `
WITH moved AS (
    DELETE FROM outbox o
    WHERE o.id = ANY($1::bigint[])
      AND EXISTS (
          SELECT 1 FROM outbox_aggregates a
          WHERE a.aggregate_type = o.aggregate_type
            AND a.aggregate_id = o.aggregate_id
            AND a.published_version >= o.aggregate_version)
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type,
              o.payload, o.headers, o.created_at, o.attempts
), unblocked AS (
    UPDATE outbox s
    SET blocked = false
    FROM moved m
    WHERE s.aggregate_type = m.aggregate_type
      AND s.aggregate_id = m.aggregate_id
      AND s.aggregate_version = m.aggregate_version + 1
      AND s.blocked
)
INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                              payload, headers, created_at, attempts)
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at, attempts
FROM moved
ON CONFLICT (id) DO NOTHING`

type aggregateKey struct{ typ, id string }

// markPublished moves confirmed rows to outbox_published, in one transaction of
// two statements sent in one round trip. It returns the rows it could not mark
// yet because a writer held their aggregate; rows already moved by another
// relay (after a lease expired) count as marked.
func markPublished(ctx context.Context, db batchSender, envs []Envelope) (deferred []Envelope, err error) {
	types := make([]string, len(envs))
	aggIDs := make([]string, len(envs))
	versions := make([]int64, len(envs))
	for i, e := range envs {
		types[i], aggIDs[i], versions[i] = e.AggregateType, e.AggregateID, e.AggregateVersion
	}

	b := &pgx.Batch{}
	b.Queue(lockAggregatesSQL, types, aggIDs, versions)
	b.Queue(moveSQL, ids(envs))
	br := db.SendBatch(ctx, b)
	defer br.Close()

	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("mark outbox rows published: lock aggregates: %w", err)
	}
	lockedKeys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (aggregateKey, error) {
		var k aggregateKey
		err := r.Scan(&k.typ, &k.id)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("mark outbox rows published: lock aggregates: %w", err)
	}
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("mark outbox rows published: move: %w", err)
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("mark outbox rows published: %w", err)
	}

	locked := make(map[aggregateKey]bool, len(lockedKeys))
	for _, k := range lockedKeys {
		locked[k] = true
	}
	for _, e := range envs {
		if !locked[aggregateKey{e.AggregateType, e.AggregateID}] {
			deferred = append(deferred, e)
		}
	}
	return deferred, nil
}

// failure is the outcome of one failed publish attempt.
type failure struct {
	env    Envelope
	err    string
	delay  time.Duration // until the next attempt
	dead   bool          // reached MaxAttempts
	refund bool          // never sent: give the attempt back

	unroutable bool // returned by the broker, for metrics
}

// failSQL records failed attempts in one statement. The attempts column is the
// fencing token: a row another relay claimed since (after this relay's lease
// ended) is left alone.
const failSQL = `
WITH f AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[], $5::bool[], $6::bool[])
        AS f(id, attempts, err, delay_ms, dead, refund)
)
UPDATE outbox o
SET attempts         = CASE WHEN f.refund THEN o.attempts - 1 ELSE o.attempts END,
    last_error       = CASE WHEN f.refund THEN o.last_error ELSE f.err END,
    next_attempt_at  = now() + f.delay_ms * interval '1 millisecond',
    dead_lettered_at = CASE WHEN f.dead AND NOT f.refund THEN now() END
FROM f
WHERE o.id = f.id AND o.attempts = f.attempts AND o.dead_lettered_at IS NULL
RETURNING o.id`

// recordFailures writes fs and returns the ids it updated.
func recordFailures(ctx context.Context, db DB, fs []failure) (map[int64]bool, error) {
	n := len(fs)
	var (
		fids     = make([]int64, n)
		attempts = make([]int32, n)
		errs     = make([]string, n)
		delays   = make([]int64, n)
		dead     = make([]bool, n)
		refund   = make([]bool, n)
	)
	for i, f := range fs {
		fids[i], attempts[i], errs[i] = f.env.ID, int32(f.env.Attempt), f.err
		delays[i], dead[i], refund[i] = f.delay.Milliseconds(), f.dead, f.refund
	}
	rows, err := db.Query(ctx, failSQL, fids, attempts, errs, delays, dead, refund)
	if err != nil {
		return nil, fmt.Errorf("record outbox publish failures: %w", err)
	}
	updated, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("record outbox publish failures: %w", err)
	}
	out := make(map[int64]bool, len(updated))
	for _, id := range updated {
		out[id] = true
	}
	return out, nil
}

func ids(envs []Envelope) []int64 {
	out := make([]int64, len(envs))
	for i, e := range envs {
		out[i] = e.ID
	}
	return out
}

package outbox

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/headerjson"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
)

// claimSQL leases up to $1 due head events for $2 milliseconds, in one short
// transaction of its own, and dead-letters due rows still in flight that
// already had $3 (MaxAttempts) attempts.
//
// A head event is the oldest event of its aggregate still in the outbox. Rows
// behind it are "blocked" and are not in the outbox_due index at all, so the
// scan reads about as many entries as it returns however long the queue behind
// an in-flight, failing or dead-lettered event. The NOT EXISTS re-checks the
// head rule on the rows the scan returns; ordering rests on it for rows that
// are not blocked although they are not heads: rows Enqueue writes at
// REPEATABLE READ or SERIALIZABLE, and rows inserted without Enqueue.
//
// The lease (leased_until in the future) takes the row out of the due rows
// once this statement commits, so no row lock is held while publishing, and a
// relay that dies with the row is replaced when the lease ends. The lease
// has a column of its own, in no index, so this update changes no indexed
// column and is HOT when the row's page has room (at a steady rate, where
// the page was pruned of the rows moved out; see the schema's fillfactor): no
// index entries per claimed row. The row's entry in
// outbox_due stays where it was, so a claim also reads the entries of the
// rows in flight (a batch per worker) and skips them. attempts is
// incremented here, so a crash mid-publish counts as an attempt; the relay's
// later updates use it as a fencing token. The rows are locked FOR NO KEY
// UPDATE, which a writer's KEY SHARE lock on the head (see insertSQL) does not
// exclude.
//
// in_flight says a claimed row has no outcome written yet. A due row still in
// flight lost its relay mid-publish (see the schema). Most such stops are not
// the row's doing (a deploy without a graceful stop, an out-of-memory kill, a
// database failover), and every row of the relay's batches is left so: they
// go back into normal batches, and the claim sets suspect on them. A row that
// is suspect when it is due again was in flight at two stops in a row (or its
// batch was refused by the broker, see failSQL): it may be what stops its
// relays, so it is claimed alone, the first one of the due rows, and the
// others wait for the next claim. A due row still in flight that reached
// MaxAttempts is dead-lettered here, with a reason, never handed to the
// publisher again, and stays suspect, so a retry by an operator goes out
// alone: without this, a row that kills every relay that publishes it would
// never get a failure recorded. A row that is not in flight has an outcome: a
// failure, which dead-lettered it already at MaxAttempts (failSQL), or a
// confirm its relay could not mark (releaseUnmarkedSQL), which is no failure:
// it is claimed again whatever its attempts, and dead-lettered only if that
// attempt fails.
//
// The batch stops at $4 bytes of payloads and headers (as text: what the
// relay holds in memory), in due order, but takes its first row whatever its
// size, so a row larger than the budget goes out alone.
//
// $5 says whether the claim may take a suspect row alone: the relay claims
// so only while no other claim of its process is in flight (Relay.solo), so
// that a crash that row causes charges no other row. A claim that may not
// returns no row to publish while a suspect row is due, and says so.
//
// The result has the claimed rows (kind 'claimed'), then the dead-lettered
// ones (kind 'dead'), then, for a claim that may not take a suspect row
// while one is due, a row of kind 'alone_due' and no data.
//
// Runs. The heads leave room in the batch ($1 minus their number), shared
// among them (share): behind each head that never failed (last_error is
// NULL: a head that failed is likely to fail again, and each failure sends
// the run behind it once more), the claim takes the next events of its
// aggregate that are due, not dead-lettered, not suspect and not spent, in
// version order, and keeps the consecutive ones (runs: a row it skips, or
// could not lock, ends the run). Those rows are blocked, so they are not in
// outbox_due; each head costs one index probe of outbox_aggregate_version,
// and none when heads fill the batch (share is 0: the lateral is not run).
// The relay sends a run in version order and marks an event only if every
// earlier one of its run was confirmed (see Relay.claimAndPublish); the claim's updates below apply to
// each row of a run as to a head: a row in flight at a stop becomes suspect,
// and a suspect row only ever goes alone, as a head.
//
// There is no id cursor: ids are allocated at insert, not at commit, so a
// cursor would skip rows that commit late. A row is pending until it is moved.
const claimSQL = `
WITH due AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.last_error IS NULL AS clean, o.attempts, o.in_flight, o.suspect,
           o.in_flight AND o.attempts >= $3::int AS spent,
           o.next_attempt_at, octet_length(o.payload::text) + octet_length(o.headers::text) AS bytes
    FROM outbox o
    WHERE o.dead_lettered_at IS NULL
      AND NOT o.blocked
      AND o.next_attempt_at <= now()
      AND o.leased_until <= now()
      AND NOT EXISTS (
          SELECT 1 FROM outbox p
          WHERE p.aggregate_type = o.aggregate_type
            AND p.aggregate_id = o.aggregate_id
            AND p.aggregate_version < o.aggregate_version)
    ORDER BY o.next_attempt_at, o.id
    LIMIT $1
    FOR NO KEY UPDATE SKIP LOCKED
), dead AS (
    UPDATE outbox o
    SET dead_lettered_at = now(),
        in_flight = false,
        suspect = true,
        last_error = format('no outcome after attempt %s of %s: the relay stopped (crashed, was killed or ran out of memory) while publishing it, and the lease ended', o.attempts, $3::int)
    FROM due d
    WHERE o.id = d.id AND d.spent
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type,
              o.payload, o.headers, o.created_at, o.attempts, o.last_error
), alone AS (
    SELECT id FROM due WHERE suspect AND NOT spent AND $5::bool ORDER BY id LIMIT 1
), heads AS (
    SELECT * FROM due
    WHERE NOT suspect AND NOT spent AND NOT EXISTS (SELECT FROM due WHERE suspect AND NOT spent)
), share AS (
    SELECT CASE WHEN count(*) = 0 THEN 0 ELSE ceil(greatest($1::int - count(*), 0)::numeric / count(*))::int END AS n
    FROM heads
), followers AS (
    SELECT f.id, h.id AS head, f.aggregate_version - h.aggregate_version AS rank, f.bytes
    FROM (SELECT * FROM heads WHERE clean AND (SELECT n FROM share) > 0) h
    CROSS JOIN LATERAL (
        SELECT s.id, s.aggregate_version, octet_length(s.payload::text) + octet_length(s.headers::text) AS bytes
        FROM outbox s
        WHERE s.aggregate_type = h.aggregate_type
          AND s.aggregate_id = h.aggregate_id
          AND s.aggregate_version > h.aggregate_version
          AND s.dead_lettered_at IS NULL
          AND NOT s.suspect
          AND NOT (s.in_flight AND s.attempts >= $3::int)
          AND s.next_attempt_at <= now()
          AND s.leased_until <= now()
        ORDER BY s.aggregate_version
        LIMIT (SELECT n FROM share)
        FOR NO KEY UPDATE SKIP LOCKED
    ) f
), runs AS (
    SELECT id, head, rank, bytes
    FROM (SELECT *, row_number() OVER (PARTITION BY head ORDER BY rank) AS n FROM followers) r
    WHERE rank = n
), members AS (
    SELECT id, 0::bigint AS rank, next_attempt_at AS due_at, id AS head, bytes FROM heads
    UNION ALL
    SELECT r.id, r.rank, h.next_attempt_at, r.head, r.bytes FROM runs r JOIN heads h ON h.id = r.head
), batch AS (
    SELECT id, row_number() OVER w AS n, sum(bytes) OVER w AS running
    FROM members
    WINDOW w AS (ORDER BY rank, due_at, head)
), pick AS (
    SELECT id FROM alone
    UNION ALL
    SELECT id FROM batch WHERE n = 1 OR (n <= $1::int AND running <= $4::bigint)
), claimed AS (
    UPDATE outbox o
    SET attempts = o.attempts + 1,
        in_flight = true,
        suspect = o.suspect OR o.in_flight,
        leased_until = now() + $2::bigint * interval '1 millisecond'
    WHERE o.id IN (SELECT id FROM pick)
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type,
              o.payload, o.headers, o.created_at, o.attempts
)
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at,
       attempts, 'claimed' AS kind, NULL::text AS reason
FROM claimed
UNION ALL
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at,
       attempts, 'dead', last_error
FROM dead
UNION ALL
SELECT 0, '', '', 0, '', NULL, NULL, now(), 0, 'alone_due', NULL
WHERE NOT $5::bool AND EXISTS (SELECT FROM due WHERE suspect AND NOT spent)`

// deadAtClaim is a row the claim dead-lettered instead of handing it out.
type deadAtClaim struct {
	env    Envelope
	reason string
}

// claimHandedOverSQL is claimSQL restricted to the rows a WAL relay handed
// over to polling (a Relay whose Publisher is a relayhook.HandOver). Rows keep handed_over until they leave
// the table.
var claimHandedOverSQL = strings.NewReplacer(
	"WHERE o.dead_lettered_at IS NULL\n      AND NOT o.blocked",
	"WHERE o.dead_lettered_at IS NULL\n      AND NOT o.blocked\n      AND o.handed_over",
	"          AND s.dead_lettered_at IS NULL\n",
	"          AND s.dead_lettered_at IS NULL\n          AND s.handed_over\n").Replace(claimSQL)

// claimed is what a claim returned.
type claimed struct {
	envs []Envelope
	dead []deadAtClaim
	// aloneDue says a suspect row is due, which only a claim that may take
	// it alone takes (see claimSQL).
	aloneDue bool
}

func claim(ctx context.Context, db DB, limit int, maxBytes int64, lease time.Duration, maxAttempts int, handedOverOnly, alone bool) (claimed, error) {
	query := claimSQL
	if handedOverOnly {
		query = claimHandedOverSQL
	}
	rows, err := db.Query(ctx, query, limit, lease.Milliseconds(), maxAttempts, maxBytes, alone)
	if err != nil {
		return claimed{}, fmt.Errorf("claim outbox batch: %w", err)
	}
	defer rows.Close()
	var c claimed
	for rows.Next() {
		var (
			e       Envelope
			headers []byte
			kind    string
			reason  *string
		)
		if err := rows.Scan(&e.ID, &e.AggregateType, &e.AggregateID, &e.AggregateVersion, &e.EventType,
			&e.Payload, &headers, &e.CreatedAt, &e.Attempt, &kind, &reason); err != nil {
			return claimed{}, fmt.Errorf("claim outbox batch: %w", err)
		}
		if headers != nil {
			var err error
			if e.Headers, err = headerjson.Decode(headers); err != nil {
				return claimed{}, fmt.Errorf("claim outbox batch: headers of event %d: %w", e.ID, err)
			}
		}
		if e.Headers == nil {
			e.Headers = map[string]string{}
		}
		switch kind {
		case "dead":
			c.dead = append(c.dead, deadAtClaim{env: e, reason: *reason})
		case "alone_due":
			c.aloneDue = true
		default:
			c.envs = append(c.envs, e)
		}
	}
	if err := rows.Err(); err != nil {
		return claimed{}, fmt.Errorf("claim outbox batch: %w", err)
	}
	return c, nil
}

// moveSQL is the first statement of a mark: it moves the confirmed rows it
// can lock at once to outbox_published, and returns the ids of those it did
// not move. Rows already gone (moved by another relay after this relay's lease
// ended) are in neither and count as marked.
//
// The lock a row cannot get is most often a writer's KEY SHARE: the writer of
// the aggregate's next version holds it on this row until its transaction ends
// (see insertSQL), and its row is not visible yet. Skipping instead of waiting
// means a relay never waits on a business transaction; the row is marked again
// a moment later, once that one writer committed. Writers of later versions
// lock later rows, so no stream of writers can keep a row locked. Another
// relay's claim may also hold a row for an instant (a claim locks the rows its
// snapshot found due, and a row the relay claimed since is no longer due).
//
// A row of a run is moved only with every earlier row of its aggregate in
// this mark (held): the statement that moves an event unblocks the one after
// it (see outboxsql.UnblockNextSQL), so moving version v+1 while v stays
// would leave the event after v+1, which its writer blocked behind v+1,
// blocked behind nothing once v moves.
const moveSQL = `
WITH locked AS (
    SELECT id, aggregate_type, aggregate_id, aggregate_version FROM outbox WHERE id = ANY($1::bigint[])
    FOR UPDATE SKIP LOCKED
), unlocked AS (
    SELECT o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version
    FROM outbox o
    WHERE o.id = ANY($1::bigint[]) AND o.id NOT IN (SELECT id FROM locked)
), held AS (
    SELECT aggregate_type, aggregate_id, min(aggregate_version) AS aggregate_version
    FROM unlocked
    GROUP BY aggregate_type, aggregate_id
), movable AS (
    SELECT l.id FROM locked l
    WHERE NOT EXISTS (SELECT 1 FROM held h
                      WHERE h.aggregate_type = l.aggregate_type AND h.aggregate_id = l.aggregate_id
                        AND h.aggregate_version < l.aggregate_version)
), moved AS (
    DELETE FROM outbox o
    USING movable m
    WHERE o.id = m.id
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type,
              o.payload, o.headers, o.created_at, o.attempts
), archived AS (
    INSERT INTO outbox_published (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                                  payload, headers, created_at, attempts)
    SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at, attempts
    FROM moved
    ON CONFLICT (id) DO NOTHING
)
SELECT id FROM unlocked
UNION ALL
SELECT id FROM locked WHERE id NOT IN (SELECT id FROM movable)`

// markPublished moves confirmed rows to outbox_published, in one transaction of
// two statements sent in one round trip. It returns the rows it could not mark
// yet because the writer of their aggregate's next event held them.
//
// The transaction sets READ COMMITTED itself: the unblock must take a snapshot
// of its own, after moveSQL locked the rows, which a REPEATABLE READ or
// SERIALIZABLE session default (ALTER ROLE/DATABASE ... SET
// default_transaction_isolation) would not give it. BEGIN and COMMIT travel in
// the same batch, so this costs no round trip; if a statement fails, the
// connection is left in an aborted transaction and the pool discards it on
// release.
func markPublished(ctx context.Context, db batchSender, envs []Envelope) (deferred []Envelope, err error) {
	types := make([]string, len(envs))
	aggIDs := make([]string, len(envs))
	versions := make([]int64, len(envs))
	for i, e := range envs {
		types[i], aggIDs[i], versions[i] = e.AggregateType, e.AggregateID, e.AggregateVersion
	}

	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue(moveSQL, ids(envs))
	b.Queue(outboxsql.UnblockNextSQL, types, aggIDs, versions)
	b.Queue("COMMIT")
	br := db.SendBatch(ctx, b)
	defer br.Close()

	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("mark outbox rows published: begin: %w", err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("mark outbox rows published: move: %w", err)
	}
	skipped, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("mark outbox rows published: move: %w", err)
	}
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("mark outbox rows published: unblock: %w", err)
	}
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("mark outbox rows published: commit: %w", err)
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("mark outbox rows published: %w", err)
	}

	left := make(map[int64]bool, len(skipped))
	for _, id := range skipped {
		left[id] = true
	}
	for _, e := range envs {
		if left[e.ID] {
			deferred = append(deferred, e)
		}
	}
	return deferred, nil
}

// failure is the outcome of one failed publish attempt.
type failure struct {
	env     Envelope
	err     string
	delay   time.Duration // until the next attempt
	dead    bool          // reached MaxAttempts
	refund  bool          // not counted: give the attempt back
	suspect bool          // publish it alone from now on (see claimSQL)
	isolate bool          // its batch was refused by the broker (refund and suspect)
	behind  bool          // sent after a failed event of its aggregate (refund)

	unroutable bool // returned by the broker, for metrics
}

// failSQL records failed attempts in one statement. The attempts column is the
// fencing token: a row another relay claimed since (after this relay's lease
// ended) is left alone. An outcome takes the row out of flight, and clears
// suspect unless the failure says it is one; a refunded attempt (the message
// was never sent) keeps it as it was.
const failSQL = `
WITH f AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::bigint[], $5::bool[], $6::bool[], $7::bool[])
        AS f(id, attempts, err, delay_ms, dead, refund, suspect)
)
UPDATE outbox o
SET attempts         = CASE WHEN f.refund THEN o.attempts - 1 ELSE o.attempts END,
    in_flight        = false,
    suspect          = f.suspect OR (f.refund AND o.suspect),
    last_error       = CASE WHEN f.refund AND NOT f.suspect THEN o.last_error ELSE f.err END,
    next_attempt_at  = now() + f.delay_ms * interval '1 millisecond',
    leased_until     = '-infinity',
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
		suspect  = make([]bool, n)
	)
	for i, f := range fs {
		fids[i], attempts[i], errs[i] = f.env.ID, int32(f.env.Attempt), f.err
		delays[i], dead[i], refund[i], suspect[i] = f.delay.Milliseconds(), f.dead, f.refund, f.suspect
	}
	rows, err := db.Query(ctx, failSQL, fids, attempts, errs, delays, dead, refund, suspect)
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

// releaseUnmarkedSQL takes rows the relay published but could not mark out of
// flight, keeping their lease: they are due again when it ends, like any
// failed attempt, and claimed in a batch rather than alone (the broker took
// them: they are not suspect). The attempts column fences off rows another
// relay claimed since.
const releaseUnmarkedSQL = `
UPDATE outbox o
SET in_flight = false, suspect = false
FROM unnest($1::bigint[], $2::int[]) AS f(id, attempts)
WHERE o.id = f.id AND o.attempts = f.attempts AND o.in_flight`

func releaseUnmarked(ctx context.Context, db DB, envs []Envelope) error {
	attempts := make([]int32, len(envs))
	for i, e := range envs {
		attempts[i] = int32(e.Attempt)
	}
	if _, err := db.Exec(ctx, releaseUnmarkedSQL, ids(envs), attempts); err != nil {
		return fmt.Errorf("release unmarked outbox rows: %w", err)
	}
	return nil
}

func ids(envs []Envelope) []int64 {
	out := make([]int64, len(envs))
	for i, e := range envs {
		out[i] = e.ID
	}
	return out
}

// EventState is where an event is in its life.
type EventState string

const (
	// EventPending: in the outbox, not dead-lettered: due, in flight, backing
	// off, or blocked behind an earlier event of its aggregate. It may have
	// been published already (a confirm lost, a mark not written yet).
	EventPending EventState = "pending"
	// EventPublished: the broker confirmed it; the row is in
	// outbox_published until retention purges it.
	EventPublished EventState = "published"
	// EventDeadLettered: it reached MaxAttempts and waits for an operator.
	EventDeadLettered EventState = "dead_lettered"
	// EventDiscarded: an operator discarded it (package outboxadmin).
	EventDiscarded EventState = "discarded"
)

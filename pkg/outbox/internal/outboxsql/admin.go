package outboxsql

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// The statements of package outboxadmin, an operator's actions on the
// tables, and the purge of published rows that the polling relay runs too.

// StorableText says why PostgreSQL's text cannot store s, or nil.
func StorableText(s string) error {
	if !utf8.ValidString(s) {
		return errors.New("not valid UTF-8")
	}
	if strings.ContainsRune(s, 0) {
		return errors.New("contains a NUL byte")
	}
	return nil
}

// DeadLettersSQL lists up to $2 dead letters with an id greater than $1, by id.
const DeadLettersSQL = `
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers,
       attempts, coalesce(last_error, ''), created_at, dead_lettered_at
FROM outbox
WHERE dead_lettered_at IS NOT NULL AND id > $1
ORDER BY id
LIMIT $2`

// RetrySQL gives dead letters a fresh set of attempts, due now; append
// " AND id = $1" for one of them. last_error is kept: it is the history the
// operator acted on.
const RetrySQL = `
UPDATE outbox
SET attempts = 0, next_attempt_at = now(), dead_lettered_at = NULL
WHERE dead_lettered_at IS NOT NULL`

// DiscardLockSQL is the first statement of a discard: it locks the event $1,
// waiting for the writer of the aggregate's next version if that writer holds
// it FOR KEY SHARE (see package outbox's insertSQL; writers' transactions are
// short by contract, and an operator can wait), and says whether the event is
// a dead letter.
const DiscardLockSQL = `
SELECT dead_lettered_at IS NOT NULL FROM outbox WHERE id = $1 FOR UPDATE`

// DiscardSQL is the second statement, in the same transaction at READ
// COMMITTED, with a snapshot taken after the lock was granted. It does what a
// mark does for a published event (see package outbox's moveSQL and
// UnblockNextSQL): takes the event $1 out of outbox and unblocks the
// aggregate's next event, which this snapshot shows if its writer looked at
// the event before the lock was granted (a writer that looks later waits for
// this transaction, finds the event gone and writes its row unblocked). The
// event goes to outbox_discarded, with the reason $2, instead of
// outbox_published.
const DiscardSQL = `
WITH gone AS (
    DELETE FROM outbox o
    WHERE o.id = $1 AND o.dead_lettered_at IS NOT NULL
    RETURNING o.id, o.aggregate_type, o.aggregate_id, o.aggregate_version, o.event_type, o.payload,
              o.headers, o.created_at, o.attempts, o.last_error, o.dead_lettered_at
), unblocked AS (
    UPDATE outbox s
    SET blocked = false
    FROM gone g
    WHERE s.aggregate_type = g.aggregate_type
      AND s.aggregate_id = g.aggregate_id
      AND s.aggregate_version = g.aggregate_version + 1
      AND s.blocked
)
INSERT INTO outbox_discarded (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
                              headers, created_at, attempts, last_error, dead_lettered_at, reason)
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
       headers, created_at, attempts, last_error, dead_lettered_at, $2
FROM gone`

// StatusCountLimit bounds how many rows StatusSQL counts.
const StatusCountLimit = 1000

// StatusSQL reads the backlog at a bounded cost: the statistics' count of
// live rows in outbox, the pending rows counted up to StatusCountLimit + 1,
// the dead letters counted up to StatusCountLimit + 1, and the age of the
// oldest pending row in microseconds. Each part reads the table in a way the
// planner picks whatever the table's size and even without column statistics
// (a table autovacuum never analyzed):
//
//   - est is the statistics' count of live rows in outbox: no table access.
//   - counted counts the pending rows, and finds the oldest, reading one row
//     more than the limit at most, and only when est says the backlog is
//     small: above that, the one-time filter skips the scan.
//   - walk finds the pending row with the smallest id, dead counts the dead
//     letters up to one more than the limit: one index lookup per row, in the
//     primary key and in the dead letters' partial index.
//
// It has no parameters, so a connection plans it once (a generic plan), and
// that plan is the same on an empty outbox as on a large one: a plan made when
// the process started stays cheap when an outage grows the backlog.
var StatusSQL = fmt.Sprintf(`
WITH RECURSIVE est AS MATERIALIZED (
    SELECT greatest(coalesce(pg_stat_get_live_tuples('outbox'::regclass), 0), 0) AS live
), counted AS (
    SELECT count(*) AS n, min(created_at) AS oldest
    FROM (SELECT created_at FROM outbox
          WHERE dead_lettered_at IS NULL AND (SELECT live FROM est) <= %[1]d
          LIMIT %[1]d + 1) p
), walk (id, created_at, dead, n) AS (
    (SELECT id, created_at, dead_lettered_at IS NOT NULL, 1 FROM outbox ORDER BY id LIMIT 1)
    UNION ALL
    (SELECT o.id, o.created_at, o.dead, w.n + 1
     FROM walk w
     CROSS JOIN LATERAL (
         SELECT id, created_at, dead_lettered_at IS NOT NULL AS dead
         FROM outbox WHERE outbox.id > w.id ORDER BY outbox.id LIMIT 1) o
     WHERE w.dead AND w.n <= %[1]d)
), dead (id, n) AS (
    (SELECT id, 1 FROM outbox WHERE dead_lettered_at IS NOT NULL ORDER BY id LIMIT 1)
    UNION ALL
    (SELECT o.id, d.n + 1
     FROM dead d
     CROSS JOIN LATERAL (
         SELECT id FROM outbox
         WHERE dead_lettered_at IS NOT NULL AND outbox.id > d.id ORDER BY outbox.id LIMIT 1) o
     WHERE d.n <= %[1]d)
)
SELECT (SELECT live FROM est), (SELECT n FROM counted), (SELECT count(*) FROM dead),
       coalesce((extract(epoch FROM now() - least(
           (SELECT oldest FROM counted),
           (SELECT created_at FROM walk WHERE NOT dead))) * 1e6)::bigint, 0)`, StatusCountLimit)

// MaxHistory bounds the events HistorySQL returns: an aggregate's most
// recent MaxHistory events.
const MaxHistory = 1000

// HistorySQL reads the most recent events of the aggregate ($1 type, $2 id)
// from the three tables, newest first: id, aggregate_version, event_type,
// created_at, state (an outbox.EventState), in flight, attempts, last_error,
// when it is due (next_attempt_at, or the end of its lease), since,
// dead_lettered_at and headers. outbox and
// outbox_published are read through their (aggregate_type, aggregate_id,
// aggregate_version) indexes; outbox_discarded, which holds the rare
// discarded dead letters only, has no index by aggregate and is scanned.
var HistorySQL = fmt.Sprintf(`
SELECT * FROM (
    SELECT id, aggregate_version, event_type, created_at,
           CASE WHEN dead_lettered_at IS NULL THEN 'pending' ELSE 'dead_lettered' END,
           in_flight AND dead_lettered_at IS NULL, attempts, last_error,
           CASE WHEN dead_lettered_at IS NULL THEN greatest(next_attempt_at, leased_until) END,
           dead_lettered_at, dead_lettered_at, headers
    FROM outbox WHERE aggregate_type = $1 AND aggregate_id = $2
    UNION ALL
    SELECT id, aggregate_version, event_type, created_at, 'published', false, attempts, NULL,
           NULL, published_at, NULL, headers
    FROM outbox_published WHERE aggregate_type = $1 AND aggregate_id = $2
    UNION ALL
    SELECT id, aggregate_version, event_type, created_at, 'discarded', false, attempts, last_error,
           NULL, discarded_at, dead_lettered_at, headers
    FROM outbox_discarded WHERE aggregate_type = $1 AND aggregate_id = $2
) h
ORDER BY 2 DESC
LIMIT %d`, MaxHistory)

// MaxPurgeBatch bounds the batch size of Purge.
const MaxPurgeBatch = 100_000

// purgeSQL deletes one batch of old published rows. SKIP LOCKED lets several
// relays purge at once without waiting on each other.
const purgeSQL = `
DELETE FROM outbox_published
WHERE id IN (
    SELECT id FROM outbox_published
    WHERE published_at < now() - $1::bigint * interval '1 microsecond'
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)`

// Purge deletes published rows older than olderThan, batchSize rows per
// statement (1 to MaxPurgeBatch; each its own short transaction), until none
// is left, and returns how many it deleted. ctx stops it between (or during)
// batches.
func Purge(ctx context.Context, db DB, olderThan time.Duration, batchSize int) (int64, error) {
	if olderThan <= 0 {
		return 0, fmt.Errorf("outbox purge: olderThan %v: must be positive", olderThan)
	}
	if batchSize < 1 || batchSize > MaxPurgeBatch {
		return 0, fmt.Errorf("outbox purge: batchSize %d: must be in 1..%d", batchSize, MaxPurgeBatch)
	}
	var total int64
	for {
		tag, err := db.Exec(ctx, purgeSQL, olderThan.Microseconds(), batchSize)
		if err != nil {
			return total, fmt.Errorf("outbox purge: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batchSize) {
			return total, nil
		}
	}
}

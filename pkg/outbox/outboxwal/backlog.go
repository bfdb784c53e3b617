package outboxwal

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
)

// A backlog is the rows a session's stream does not cover: the rows in the
// outbox when the slot was made (its stream starts after them), or every row
// when the session cannot vouch for the slot (see session). They go to
// polling, and the later events of their aggregates wait behind them.
//
// With a large outbox (a first start on a busy table, a failover), handing
// them over in one statement takes longer than any deadline a relay can
// give a statement, and the relay would start over for ever. So the hand-over
// is a walk in bounded steps, each a short transaction with its own deadline:
//
//  1. Listing: the rows' ids and aggregates are read in chunks of
//     listChunk, by id (for a new slot, each chunk in the snapshot the slot
//     exported, while the replication connection waits: exactly the rows its
//     stream lacks). The first markChunk rows are handed over at once, and
//     the session's polling relay, running from the session's start,
//     publishes them while the rest is listed. The aggregates become pins: until the hand-over is done
//     and each listed row has left the table or been dead-lettered, an event
//     of a pinned aggregate that comes through the stream is parked behind
//     them (handed over), never published ahead of them.
//  2. Streaming starts: events of other aggregates are published at once.
//  3. Marking, beside the stream: the listed rows are handed over in chunks of
//     markChunk, each retried until it commits. Polling publishes them as
//     they are marked.
//  4. Done: the slot's server is recorded (and a new slot marked ready) in a
//     fenced transaction; until then a session that starts anew lists and
//     marks again, and what the earlier one marked stays handed over: the
//     progress survives a crash or a takeover.
type backlog struct {
	reason string
	// toMark are the listed rows not handed over yet, in id order: only the
	// marking goroutine touches them.
	toMark []int64
	// all are the listed rows, in id order, and next the first of them that
	// may still be undelivered: only the refresher touches them.
	all  []int64
	next int
	// pins are the listed rows' aggregates, hashed with seed; the state keeps
	// them (state.pins) until released.
	pins map[uint64]struct{}
	seed maphash.Seed
	// marked says step 3 ended and step 4 committed.
	marked atomic.Bool
}

const (
	// listChunk is how many rows one listing statement reads.
	listChunk = 50_000
	// markChunk is how many rows one hand-over transaction marks.
	markChunk = 5_000
	// releaseChunk is how many listed rows the refresher looks up at once.
	releaseChunk = 10_000
)

// listed says whether row id is one of the backlog's.
func (b *backlog) listed(id int64) bool {
	_, ok := slices.BinarySearch(b.all, id)
	return ok
}

func (b *backlog) pinned(k aggKey) bool {
	_, ok := b.pins[b.hash(k)]
	return ok
}

func (b *backlog) hash(k aggKey) uint64 {
	var h maphash.Hash
	h.SetSeed(b.seed)
	h.WriteString(k.typ)
	h.WriteByte(0) // no NUL in an aggregate type
	h.WriteString(k.id)
	return h.Sum64()
}

// listBacklog reads every row of the outbox in chunks by id, each in a
// transaction of its own with its own deadline, in snapshot when it is not
// empty (the slot's exported snapshot: it stays valid while the replication
// connection that exported it runs no other command).
func listBacklog(ctx context.Context, pool *pgxpool.Pool, snapshot, reason string) (*backlog, error) {
	b := &backlog{reason: reason, pins: map[uint64]struct{}{}, seed: maphash.MakeSeed()}
	var after int64
	for {
		var chunk []outboxsql.RowRef
		err := func() error {
			cctx, cancel := context.WithTimeout(ctx, dbTimeout)
			defer cancel()
			return pgx.BeginTxFunc(cctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
				if snapshot != "" {
					if _, err := tx.Exec(cctx, "SET TRANSACTION SNAPSHOT '"+strings.ReplaceAll(snapshot, "'", "''")+"'"); err != nil {
						return fmt.Errorf("import the slot's snapshot: %w", err)
					}
				}
				var err error
				chunk, err = outboxsql.ListRows(cctx, tx, after, listChunk)
				return err
			})
		}()
		if err != nil {
			return nil, fmt.Errorf("list the rows the slot does not cover: %w", err)
		}
		for _, r := range chunk {
			b.all = append(b.all, r.ID)
			if !r.HandedOver {
				b.toMark = append(b.toMark, r.ID)
			}
			b.pins[b.hash(aggKey{r.Aggregate.Type, r.Aggregate.ID})] = struct{}{}
		}
		if after == 0 && len(b.toMark) > 0 {
			// The first rows go to polling at once, so the backlog starts
			// to go out while the rest is listed. Should this fail, they
			// are marked with the others.
			n := min(markChunk, len(b.toMark))
			cctx, cancel := context.WithTimeout(ctx, dbTimeout)
			if _, err := outboxsql.HandOverRows(cctx, pool, b.toMark[:n], b.reason); err == nil {
				b.toMark = b.toMark[n:]
			}
			cancel()
		}
		if len(chunk) < listChunk {
			return b, nil
		}
		after = chunk[len(chunk)-1].ID
	}
}

// markBacklog hands over b's listed rows in chunks, each in a transaction of
// its own with its own deadline, retrying a chunk that fails until ctx ends.
func markBacklog(ctx context.Context, pool *pgxpool.Pool, b *backlog, log *slog.Logger) error {
	total, start, lastLog := len(b.toMark), time.Now(), time.Now()
	var failures int
	for len(b.toMark) > 0 {
		n := min(markChunk, len(b.toMark))
		cctx, cancel := context.WithTimeout(ctx, dbTimeout)
		_, err := outboxsql.HandOverRows(cctx, pool, b.toMark[:n], b.reason)
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			failures++
			wait := retry.Jitter(retry.Backoff(failures, 100*time.Millisecond, 5*time.Second))
			log.WarnContext(ctx, "outbox WAL relay: could not hand a chunk of rows over to polling; trying again",
				slog.Any("error", err), slog.Int("rows", n), slog.Int("attempt", failures), slog.Duration("retry_in", wait))
			retry.Sleep(ctx, wait)
			continue
		}
		failures = 0
		b.toMark = b.toMark[n:]
		if time.Since(lastLog) >= 10*time.Second {
			lastLog = time.Now()
			log.InfoContext(ctx, "outbox WAL relay: handing rows over to polling",
				slog.Int("handed_over", total-len(b.toMark)), slog.Int("total", total))
		}
	}
	if total > 0 {
		log.InfoContext(ctx, "outbox WAL relay: handed the rows the slot does not cover over to polling",
			slog.Int("rows", total), slog.Duration("took", time.Since(start)))
	}
	return nil
}

// finishBacklog records, in a transaction fenced by f (or unfenced under the
// slot's creation lock when f is nil), that the slot covers the outbox on
// its server, and, for a slot this relay made (comment not empty), that it
// is ready. It retries until ctx ends.
func (r *Relay) finishBacklog(ctx context.Context, f *fence, server, comment string) error {
	var failures int
	for {
		cctx, cancel := context.WithTimeout(ctx, dbTimeout)
		work := func(tx pgx.Tx) error {
			if _, err := tx.Exec(cctx, recordSlotServerSQL, r.cfg.Slot, server); err != nil {
				return fmt.Errorf("record the slot's server: %w", err)
			}
			if comment != "" {
				if _, err := tx.Exec(cctx, "COMMENT ON PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+" IS '"+comment+"'"); err != nil {
					return fmt.Errorf("mark slot %s ready: %w", r.cfg.Slot, err)
				}
			}
			return nil
		}
		var err error
		if f != nil {
			err = fencedTx(cctx, r.pool, *f, work)
		} else {
			err = pgx.BeginFunc(cctx, r.pool, work)
		}
		cancel()
		if err == nil || errors.Is(err, errFenced) || ctx.Err() != nil {
			return errors.Join(err, ctx.Err())
		}
		failures++
		wait := retry.Jitter(retry.Backoff(failures, 100*time.Millisecond, 5*time.Second))
		r.log.WarnContext(ctx, "outbox WAL relay: could not record the end of the hand-over; trying again",
			slog.Any("error", err), slog.Int("attempt", failures), slog.Duration("retry_in", wait))
		retry.Sleep(ctx, wait)
	}
}

// releaseStep advances b.next past the listed rows that left the table or
// were dead-lettered, a few chunks at a time, and says whether none is left
// undelivered.
func releaseStep(ctx context.Context, pool *pgxpool.Pool, b *backlog) (bool, error) {
	for range 10 {
		if b.next >= len(b.all) {
			return true, nil
		}
		end := min(b.next+releaseChunk, len(b.all))
		cctx, cancel := context.WithTimeout(ctx, dbTimeout)
		first, err := outboxsql.FirstUndelivered(cctx, pool, b.all[b.next:end])
		cancel()
		if err != nil {
			return false, err
		}
		if first == 0 {
			b.next = end
			continue
		}
		for b.all[b.next] < first {
			b.next++
		}
		return false, nil
	}
	return b.next >= len(b.all), nil
}

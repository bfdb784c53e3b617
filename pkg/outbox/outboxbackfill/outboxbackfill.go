// Package outboxbackfill replays the outbox's archive (outbox_published) to
// one new consumer, for a service added after the events it needs were
// published. It drives any outbox.Publisher; on RabbitMQ, an
// outboxamqp.Publisher with Config.Queue set, which sends to the new queue
// alone, so the consumers already bound see nothing of the replay.
//
// # The hand-over to the live flow
//
//  1. The new service declares its queue and binds it: from then on, the
//     relays' messages reach it too.
//  2. The backfill starts. Its first start fixes Until: the database's
//     clock. It waits until the outbox holds no event of its selection
//     created up to Until, dead letters aside (Progress and the log count
//     those left), then replays the archived ones, each aggregate's in version
//     order, with the live relay's message ids and headers.
//  3. The new consumer's inbox absorbs the overlap: events created before
//     Until and published after the binding arrive twice, under the same
//     message id.
//
// No event falls between the two. A relay sends an event once its
// transaction has committed, and created_at is that transaction's start: one
// sent before the binding was created before Until. Its row may stay in the
// outbox after the broker's confirm (a paused relay, a writer holding it),
// so the wait lasts until it is archived (by either relay; the WAL relay's
// Config.Archive). Events committed after the wait began, and dead letters
// with the events behind them, go out after the binding (once retried).
// Discarded and purged events (retention, Admin.Purge) are not replayed.
//
// # Throttle, checkpoint, progress
//
// Config.Rate bounds the events sent per second. After each
// confirmed batch, the position reached (aggregate type, id, version) goes to
// the outbox_backfill table, which this package creates and owns, under
// Config.Name: a Run that starts again after a crash or a stop goes on from
// there, sending at most the batch that was in flight again (the inbox
// absorbs it). A finished backfill's Run returns at once. Progress reports
// where it is; Run logs it every Config.ProgressInterval.
//
// Run one process per Name at a time.
package outboxbackfill

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/headerjson"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
)

// DB is what a Backfill needs: *pgxpool.Pool and *pgx.Conn satisfy it. It
// must reach the outbox tables (its search_path).
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Aggregate names one aggregate.
type Aggregate struct {
	Type, ID string
}

// Config configures a Backfill. The zero value of every optional field means
// its default.
type Config struct {
	// Name identifies the backfill and its checkpoint: the new consumer's
	// queue, say. Required, at most 200 bytes.
	Name string
	// From: replay the events created at or after From. Default: from the
	// oldest the archive holds.
	From time.Time
	// Until: replay the events created up to Until. Default: fixed at the
	// first start, the database's clock. One before the new queue was bound
	// narrows the replay: events created after it and sent before the
	// binding are left out. A resumed backfill keeps the Until it started
	// with.
	Until time.Time
	// Aggregates limits the replay to these aggregates. Default: all.
	Aggregates []Aggregate
	// Rate bounds the events sent per second. Default DefaultRate.
	Rate float64
	// BatchSize is how many events one PublishBatch carries, and one
	// checkpoint covers. Default DefaultBatchSize, at most MaxBatchSize.
	BatchSize int
	// PublishTimeout bounds one PublishBatch. Default DefaultPublishTimeout.
	PublishTimeout time.Duration
	// RetryBackoffMin and RetryBackoffMax bound the exponential backoff
	// after a failed publish. Defaults DefaultRetryBackoffMin and
	// DefaultRetryBackoffMax.
	RetryBackoffMin, RetryBackoffMax time.Duration
	// ProgressInterval is how often Run logs its progress, and what it
	// waits for before the replay. Default
	// DefaultProgressInterval.
	ProgressInterval time.Duration
	// Logger receives the progress and the failures. Default slog.Default().
	Logger *slog.Logger
}

// Defaults of Config.
const (
	DefaultRate             = 1000.0
	DefaultBatchSize        = 100
	MaxBatchSize            = 1000
	DefaultPublishTimeout   = 10 * time.Second
	DefaultRetryBackoffMin  = 100 * time.Millisecond
	DefaultRetryBackoffMax  = 10 * time.Second
	DefaultProgressInterval = 10 * time.Second
	maxNameBytes            = 200
)

// ErrOtherSelection is returned by Run when the checkpoint under
// Config.Name was made for another From, Until or Aggregates.
var ErrOtherSelection = errors.New("outboxbackfill: the checkpoint under this name was made for another selection")

// Backfill replays the archive to one target. Make it with New.
type Backfill struct {
	db     DB
	target outbox.Publisher
	cfg    Config
	log    *slog.Logger

	mu       sync.Mutex
	progress Progress
}

// Progress is where a backfill is.
type Progress struct {
	// Until is the upper bound of the replay, on the events' creation;
	// zero before Run fixed it.
	Until time.Time
	// Waiting is how many of the selection's events created up to Until
	// the wait last found in the outbox (dead letters aside), OldestWaiting
	// the smallest of their ids; zero once the wait is over.
	Waiting, OldestWaiting int64
	// Total is how many events the replay covers, counted once the wait is
	// over (-1 before), Replayed how many it sent and checkpointed so far.
	Total, Replayed int64
	// Position is the last event checkpointed.
	Position Position
	// Finished says every event was replayed.
	Finished bool
}

// Position names an archived event: the replay's order is by aggregate
// type, id, then version.
type Position struct {
	AggregateType, AggregateID string
	AggregateVersion           int64
}

// New validates cfg and returns a Backfill reading db's archive and
// publishing to target.
func New(db DB, target outbox.Publisher, cfg Config) (*Backfill, error) {
	switch {
	case db == nil || target == nil:
		return nil, errors.New("outboxbackfill: a DB and a target are required")
	case cfg.Name == "":
		return nil, errors.New("outboxbackfill: Name is required")
	case len(cfg.Name) > maxNameBytes:
		return nil, fmt.Errorf("outboxbackfill: Name has %d bytes, more than %d", len(cfg.Name), maxNameBytes)
	case !cfg.Until.IsZero() && cfg.Until.Before(cfg.From):
		return nil, fmt.Errorf("outboxbackfill: Until %v is before From %v", cfg.Until, cfg.From)
	case cfg.Rate < 0 || cfg.Rate != cfg.Rate:
		return nil, fmt.Errorf("outboxbackfill: Rate %v: must be positive", cfg.Rate)
	case cfg.BatchSize < 0 || cfg.BatchSize > MaxBatchSize:
		return nil, fmt.Errorf("outboxbackfill: BatchSize %d: must be in 1..%d", cfg.BatchSize, MaxBatchSize)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"PublishTimeout", cfg.PublishTimeout}, {"RetryBackoffMin", cfg.RetryBackoffMin},
		{"RetryBackoffMax", cfg.RetryBackoffMax}, {"ProgressInterval", cfg.ProgressInterval}} {
		if d.v < 0 {
			return nil, fmt.Errorf("outboxbackfill: %s is negative", d.name)
		}
	}
	// The database keeps microseconds: a resumed backfill compares Until with it.
	cfg.From, cfg.Until = cfg.From.Truncate(time.Microsecond), cfg.Until.Truncate(time.Microsecond)
	cfg.Aggregates = slices.Clone(cfg.Aggregates)
	slices.SortFunc(cfg.Aggregates, func(a, b Aggregate) int {
		return cmp.Or(cmp.Compare(a.Type, b.Type), cmp.Compare(a.ID, b.ID))
	})
	cfg.Aggregates = slices.Compact(cfg.Aggregates)
	cfg.Rate = cmp.Or(cfg.Rate, DefaultRate)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultBatchSize)
	cfg.PublishTimeout = cmp.Or(cfg.PublishTimeout, DefaultPublishTimeout)
	cfg.RetryBackoffMin = cmp.Or(cfg.RetryBackoffMin, DefaultRetryBackoffMin)
	cfg.RetryBackoffMax = cmp.Or(cfg.RetryBackoffMax, max(DefaultRetryBackoffMax, cfg.RetryBackoffMin))
	if cfg.RetryBackoffMin > cfg.RetryBackoffMax {
		return nil, fmt.Errorf("outboxbackfill: RetryBackoffMin %v exceeds RetryBackoffMax %v", cfg.RetryBackoffMin, cfg.RetryBackoffMax)
	}
	cfg.ProgressInterval = cmp.Or(cfg.ProgressInterval, DefaultProgressInterval)
	log := cmp.Or(cfg.Logger, slog.Default()).With(slog.String("backfill", cfg.Name))
	return &Backfill{db: db, target: target, cfg: cfg, log: log}, nil
}

// Progress returns where the backfill is; safe to call while Run runs.
func (b *Backfill) Progress() Progress {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.progress
}

func (b *Backfill) setProgress(p Progress) {
	b.mu.Lock()
	b.progress = p
	b.mu.Unlock()
}

// Run replays the selection, from its checkpoint, and returns nil once every
// event is replayed (at once for a finished backfill), or when ctx ends
// (the checkpoint keeps the position; Run again goes on from it). A message
// the target returns as unroutable (outbox.ErrUnroutable: the queue does not
// exist) ends Run with that error; other failures are retried with backoff.
func (b *Backfill) Run(ctx context.Context) error {
	if _, err := b.db.Exec(ctx, schemaSQL); err != nil {
		return fmt.Errorf("outboxbackfill %s: create the checkpoint table: %w", b.cfg.Name, err)
	}
	cp, settled, err := b.start(ctx)
	if err != nil {
		return fmt.Errorf("outboxbackfill %s: %w", b.cfg.Name, err)
	}
	b.setProgress(cp)
	if cp.Finished {
		b.log.InfoContext(ctx, "outboxbackfill: already finished", progressAttrs(cp)...)
		return nil
	}
	if settled.IsZero() {
		if settled, err = b.settle(ctx, cp); err != nil {
			return nilIfDone(ctx, fmt.Errorf("outboxbackfill %s: %w", b.cfg.Name, err))
		}
		n, err := outboxsql.CountArchive(ctx, b.db, b.sqlSelection(cp.Until, settled))
		if err == nil {
			_, err = b.db.Exec(ctx, settledSQL, b.cfg.Name, settled, n)
		}
		if err != nil {
			return nilIfDone(ctx, fmt.Errorf("outboxbackfill %s: count the events: %w", b.cfg.Name, err))
		}
		cp.Total, cp.Waiting, cp.OldestWaiting = n, 0, 0
		b.setProgress(cp)
	}
	b.log.InfoContext(ctx, "outboxbackfill: replaying", progressAttrs(cp)...)
	err = b.replay(ctx, cp, settled)
	if err != nil {
		return nilIfDone(ctx, fmt.Errorf("outboxbackfill %s: %w", b.cfg.Name, err))
	}
	b.log.InfoContext(ctx, "outboxbackfill: finished", progressAttrs(b.Progress())...)
	return nil
}

func nilIfDone(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}

func progressAttrs(p Progress) []any {
	return []any{
		slog.Int64("replayed", p.Replayed), slog.Int64("total", p.Total),
		slog.Time("until", p.Until), slog.Int64("waiting", p.Waiting), slog.Int64("oldest_waiting_id", p.OldestWaiting), slog.String("aggregate_type", p.Position.AggregateType),
		slog.String("aggregate_id", p.Position.AggregateID), slog.Int64("aggregate_version", p.Position.AggregateVersion),
	}
}

// selection is what a checkpoint was made for, stored with it.
type selection struct {
	From       time.Time   `json:"from"`
	Aggregates []Aggregate `json:"aggregates"`
}

// sqlSelection is the selection's part of the archive: created up to until,
// archived up to settled (zero: no bound).
func (b *Backfill) sqlSelection(until, settled time.Time) outboxsql.Selection {
	s := outboxsql.Selection{From: b.cfg.From, Until: until, ArchivedBy: settled}
	for _, a := range b.cfg.Aggregates {
		s.Types = append(s.Types, a.Type)
		s.IDs = append(s.IDs, a.ID)
	}
	return s
}

// start reads the checkpoint under Name, or makes it, fixing Until. It
// returns when the wait ended, zero while it has not.
func (b *Backfill) start(ctx context.Context) (Progress, time.Time, error) {
	sel, err := json.Marshal(selection{From: b.cfg.From.UTC(), Aggregates: b.cfg.Aggregates})
	if err != nil {
		return Progress{}, time.Time{}, err
	}
	var until *time.Time
	if !b.cfg.Until.IsZero() {
		until = &b.cfg.Until
	}
	tag, err := b.db.Exec(ctx, insertSQL, b.cfg.Name, string(sel), until)
	if err != nil {
		return Progress{}, time.Time{}, fmt.Errorf("make the checkpoint: %w", err)
	}
	made := tag.RowsAffected() == 1
	var (
		p         Progress
		stored    string
		total     *int64
		finished  *time.Time
		untilSeen time.Time
		settled   *time.Time
	)
	err = b.db.QueryRow(ctx, readSQL, b.cfg.Name).Scan(&stored, &untilSeen, &settled, &total, &p.Replayed,
		&p.Position.AggregateType, &p.Position.AggregateID, &p.Position.AggregateVersion, &finished)
	if err != nil {
		return Progress{}, time.Time{}, fmt.Errorf("read the checkpoint: %w", err)
	}
	p.Until, p.Finished = untilSeen, finished != nil
	if stored != string(sel) || (until != nil && !until.Equal(untilSeen)) {
		return Progress{}, time.Time{}, fmt.Errorf("%w (stored: %s, until %v; asked: %s, until %v): use another name", ErrOtherSelection,
			stored, untilSeen, sel, b.cfg.Until)
	}
	p.Total = -1 // counted once the wait is over
	if total != nil {
		p.Total = *total
	}
	if !made {
		b.log.InfoContext(ctx, "outboxbackfill: resuming from the checkpoint", progressAttrs(p)...)
	}
	if settled == nil {
		return p, time.Time{}, nil
	}
	return p, *settled, nil
}

// waitPoll is how often settle looks at the outbox.
const waitPoll = 500 * time.Millisecond

// settle waits until the outbox holds no event of the selection created up
// to p.Until that a relay may still archive (see the package
// documentation), and returns the database's clock then: the replay's bound
// on published_at.
func (b *Backfill) settle(ctx context.Context, p Progress) (time.Time, error) {
	sel := b.sqlSelection(p.Until, time.Time{})
	var logged time.Time
	for {
		o, err := outboxsql.CountOutstanding(ctx, b.db, sel)
		if err != nil {
			return time.Time{}, err
		}
		p.Waiting, p.OldestWaiting = o.Count, o.OldestID
		b.setProgress(p)
		if o.Count == 0 {
			return o.At, nil
		}
		if time.Since(logged) >= b.cfg.ProgressInterval {
			b.log.InfoContext(ctx, "outboxbackfill: waiting for the relays to archive the events created up to Until",
				progressAttrs(p)...)
			logged = time.Now()
		}
		if err := sleep(ctx, waitPoll); err != nil {
			return time.Time{}, err
		}
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// replay sends the selection from p's position, batch by batch, paced at
// Rate, checkpointing each.
func (b *Backfill) replay(ctx context.Context, p Progress, settled time.Time) error {
	sel := b.sqlSelection(p.Until, settled)
	paced := time.Now()
	lastLog := time.Now()
	for {
		key := outboxsql.Key{AggregateType: p.Position.AggregateType, AggregateID: p.Position.AggregateID, Version: p.Position.AggregateVersion}
		rows, err := outboxsql.ReadArchive(ctx, b.db, sel, key, b.cfg.BatchSize)
		if err != nil {
			return err
		}
		if len(rows) == 0 {
			if _, err := b.db.Exec(ctx, finishSQL, b.cfg.Name); err != nil {
				return fmt.Errorf("mark the checkpoint finished: %w", err)
			}
			p.Finished = true
			b.setProgress(p)
			return nil
		}
		envs := make([]outbox.Envelope, len(rows))
		for i, r := range rows {
			h, err := headerjson.Decode(r.Headers)
			if err != nil {
				return fmt.Errorf("event %d's headers: %w", r.ID, err)
			}
			envs[i] = outbox.Envelope{ID: r.ID, AggregateType: r.AggregateType, AggregateID: r.AggregateID,
				AggregateVersion: r.AggregateVersion, EventType: r.EventType, Payload: r.Payload, Headers: h,
				CreatedAt: r.CreatedAt, Attempt: r.Attempts + 1}
		}
		if err := b.publish(ctx, envs); err != nil {
			return err
		}
		last := rows[len(rows)-1]
		p.Position = Position{AggregateType: last.AggregateType, AggregateID: last.AggregateID, AggregateVersion: last.AggregateVersion}
		p.Replayed += int64(len(rows))
		if _, err := b.db.Exec(ctx, checkpointSQL, b.cfg.Name, p.Position.AggregateType, p.Position.AggregateID,
			p.Position.AggregateVersion, len(rows)); err != nil {
			return fmt.Errorf("write the checkpoint: %w", err)
		}
		b.setProgress(p)
		if time.Since(lastLog) >= b.cfg.ProgressInterval {
			b.log.InfoContext(ctx, "outboxbackfill: progress", progressAttrs(p)...)
			lastLog = time.Now()
		}
		// Pace: the next batch leaves no earlier than Rate allows for
		// the events sent so far.
		paced = paced.Add(time.Duration(float64(len(rows)) / b.cfg.Rate * float64(time.Second)))
		if now := time.Now(); paced.Before(now.Add(-time.Second)) {
			paced = now.Add(-time.Second) // no burst after a slow stretch
		}
		if err := sleep(ctx, time.Until(paced)); err != nil {
			return err
		}
	}
}

// publish sends envs until each is confirmed: after a failure, again from
// the first failed one, so an aggregate's events keep their order.
func (b *Backfill) publish(ctx context.Context, envs []outbox.Envelope) error {
	backoff := b.cfg.RetryBackoffMin
	for len(envs) > 0 {
		if err := b.target.WaitReady(ctx); err != nil {
			return fmt.Errorf("wait for the target: %w", err)
		}
		pctx, cancel := context.WithTimeout(ctx, b.cfg.PublishTimeout)
		errs := b.target.PublishBatch(pctx, envs)
		cancel()
		if len(errs) != len(envs) {
			return fmt.Errorf("the target returned %d verdicts for %d messages", len(errs), len(envs))
		}
		failed := slices.IndexFunc(errs, func(err error) bool { return err != nil })
		if failed < 0 {
			return nil
		}
		err := errs[failed]
		if errors.Is(err, outbox.ErrUnroutable) {
			return fmt.Errorf("event %d: %w (declare and bind the new queue before the backfill)", envs[failed].ID, err)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		b.log.WarnContext(ctx, "outboxbackfill: publish failed; retrying", slog.Int64("event_id", envs[failed].ID),
			slog.Any("error", err), slog.Duration("backoff", backoff))
		envs = envs[failed:]
		if err := sleep(ctx, backoff); err != nil {
			return err
		}
		backoff = min(2*backoff, b.cfg.RetryBackoffMax)
	}
	return nil
}

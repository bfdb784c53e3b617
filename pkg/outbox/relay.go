package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/relayhook"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/vacuum"
)

// RelayConfig configures a Relay. The zero value of every field means its
// default; NewRelay rejects negative or out-of-range values.
type RelayConfig struct {
	// BatchSize is how many rows one claim takes: the head event of up to
	// BatchSize aggregates and, behind each, its next events in version order
	// (a run), so one aggregate's backlog drains a batch at a time. Default
	// DefaultBatchSize, at most 10,000.
	BatchSize int
	// Workers is how many batches one relay keeps in flight at once. Each
	// uses a pool connection only while it claims or marks. Default
	// DefaultWorkers, at most 64.
	Workers int
	// MaxInFlightBytes bounds the bytes of payloads and headers in the
	// batches in flight: each worker's claim stops at MaxInFlightBytes /
	// Workers but always takes one row. The process holds about twice that.
	// Default DefaultMaxInFlightBytes; -1: no bound.
	MaxInFlightBytes int64
	// PollInterval is how often the relay looks for due rows whatever the
	// wake-ups; it alone is enough for correctness. Default
	// DefaultPollInterval, at least 10ms.
	PollInterval time.Duration
	// NotifyChannel, when set, makes the relay LISTEN on that channel, on a
	// dedicated connection, and wake on every notification: set it to the
	// writers' WriterConfig.NotifyChannel. Default "" (off).
	NotifyChannel string
	// ListenConfig is a direct connection to PostgreSQL to LISTEN on, for a
	// pool behind a transaction-pooling PgBouncer (see docs/pgbouncer.md).
	// Default nil: one made from the pool's configuration.
	ListenConfig *pgx.ConnConfig
	// ListenProbeTimeout is how long the relay waits for the notification it
	// sends itself on each new LISTEN connection; when none comes it warns,
	// reports KindListenFallback and polls alone for ListenProbeRetry.
	// Default DefaultListenProbeTimeout; -1 skips the probe.
	ListenProbeTimeout time.Duration
	// ListenProbeRetry is how long the relay polls before it tries LISTEN
	// again after a failed probe. Default DefaultListenProbeRetry.
	ListenProbeRetry time.Duration
	// ListenKeepalive is how long the LISTEN connection may stay silent before
	// the relay pings it; no answer within ListenKeepalive makes it reconnect
	// (a connection that died without an error). Default
	// DefaultListenKeepalive, at least 10ms.
	ListenKeepalive time.Duration
	// Lease is how long a claimed row is reserved for this relay; if the relay
	// dies mid-batch, others retry the row when it ends. Default
	// DefaultLease.
	Lease time.Duration
	// PublishTimeout bounds one batch's publish, first send to last confirm;
	// messages without a verdict by then failed. At most Lease/2. Default
	// DefaultPublishTimeout, or Lease/2 when shorter.
	PublishTimeout time.Duration
	// MaxAttempts is how many failed attempts dead-letter a row. An attempt
	// is counted at claim (so a relay crash counts) and given back for
	// ErrNotSent. A row in flight at two relay stops in a row is retried
	// alone. Default DefaultMaxAttempts.
	MaxAttempts int
	// RetryBackoffMin and RetryBackoffMax bound the exponential backoff
	// between attempts, each with jitter down to half. Defaults
	// DefaultRetryBackoffMin and DefaultRetryBackoffMax.
	RetryBackoffMin time.Duration
	RetryBackoffMax time.Duration
	// PublishedRetention, when set, makes the relay delete rows published
	// longer ago, every PurgeInterval, PurgeBatchSize rows per statement.
	// Default 0: keep them (or use outboxadmin's Admin.Purge).
	PublishedRetention time.Duration
	// PurgeInterval is the period of the purge. Default DefaultPurgeInterval.
	PurgeInterval time.Duration
	// PurgeBatchSize is the size of each purge statement. Default
	// DefaultPurgeBatchSize, at most 100,000.
	PurgeBatchSize int
	// VacuumEvery is how many rows the relay moves out of the outbox between
	// two VACUUMs it runs itself (the claim slows down over dead tuples).
	// Default 0: every 5,000 rows if autovacuum is off for the table, else
	// never; a positive value: always; -1: never. It needs the table's owner.
	VacuumEvery int
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
	// Observer receives the relay's counters, timings and protocol points
	// (see Observer). Default nil: nothing is observed.
	Observer Observer
}

// batchResult is the outcome of one batch, for relayhook.BatchDone.
type batchResult = relayhook.BatchResult

// Defaults of RelayConfig: the value a zero field means.
const (
	DefaultBatchSize          = 500
	DefaultWorkers            = 2
	DefaultMaxInFlightBytes   = 64 << 20
	DefaultPollInterval       = time.Second
	DefaultListenProbeTimeout = 2 * time.Second
	DefaultListenProbeRetry   = time.Minute
	DefaultListenKeepalive    = 30 * time.Second
	DefaultLease              = 30 * time.Second
	DefaultPublishTimeout     = 10 * time.Second // or Lease/2 when that is shorter
	DefaultMaxAttempts        = 20
	DefaultRetryBackoffMin    = time.Second
	DefaultRetryBackoffMax    = 5 * time.Minute
	DefaultPurgeInterval      = time.Minute
	DefaultPurgeBatchSize     = 1000
)

// Limits of RelayConfig: larger values are refused.
const (
	maxBatchSize = 10_000
	maxWorkers   = 64
)

const (
	minPollInterval    = 10 * time.Millisecond
	minListenKeepalive = 10 * time.Millisecond

	// dbTimeout bounds each claim and mark statement. They run on a context
	// detached from Run's, so a shutdown never abandons a confirmed batch
	// halfway; this keeps that drain bounded.
	dbTimeout = 10 * time.Second
)

func (c RelayConfig) withDefaults() (RelayConfig, error) {
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"BatchSize", int64(c.BatchSize)}, {"Workers", int64(c.Workers)},
		{"PollInterval", int64(c.PollInterval)}, {"Lease", int64(c.Lease)},
		{"PublishTimeout", int64(c.PublishTimeout)}, {"MaxAttempts", int64(c.MaxAttempts)},
		{"RetryBackoffMin", int64(c.RetryBackoffMin)}, {"RetryBackoffMax", int64(c.RetryBackoffMax)},
		{"PublishedRetention", int64(c.PublishedRetention)}, {"PurgeInterval", int64(c.PurgeInterval)},
		{"PurgeBatchSize", int64(c.PurgeBatchSize)}, {"ListenKeepalive", int64(c.ListenKeepalive)},
		{"ListenProbeRetry", int64(c.ListenProbeRetry)},
	} {
		if f.v < 0 {
			return c, fmt.Errorf("outbox relay config: %s is negative", f.name)
		}
	}
	if c.MaxInFlightBytes < -1 {
		return c, fmt.Errorf("outbox relay config: MaxInFlightBytes %d: want -1 (no bound), 0 (default %d) or a number of bytes", c.MaxInFlightBytes, DefaultMaxInFlightBytes)
	}
	c.MaxInFlightBytes = cmp.Or(c.MaxInFlightBytes, DefaultMaxInFlightBytes)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.Workers = cmp.Or(c.Workers, DefaultWorkers)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.Lease = cmp.Or(c.Lease, DefaultLease)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, min(DefaultPublishTimeout, c.Lease/2))
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.RetryBackoffMin = cmp.Or(c.RetryBackoffMin, DefaultRetryBackoffMin)
	c.RetryBackoffMax = cmp.Or(c.RetryBackoffMax, max(DefaultRetryBackoffMax, c.RetryBackoffMin))
	c.PurgeInterval = cmp.Or(c.PurgeInterval, DefaultPurgeInterval)
	c.PurgeBatchSize = cmp.Or(c.PurgeBatchSize, DefaultPurgeBatchSize)
	c.ListenKeepalive = cmp.Or(c.ListenKeepalive, DefaultListenKeepalive)
	if c.ListenProbeTimeout < -1 {
		return c, fmt.Errorf("outbox relay config: ListenProbeTimeout %v: want -1 (no probe), 0 (default) or a duration", c.ListenProbeTimeout)
	}
	c.ListenProbeTimeout = cmp.Or(c.ListenProbeTimeout, DefaultListenProbeTimeout)
	c.ListenProbeRetry = cmp.Or(c.ListenProbeRetry, DefaultListenProbeRetry)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}

	switch {
	case c.BatchSize > maxBatchSize:
		return c, fmt.Errorf("outbox relay config: BatchSize %d: at most %d", c.BatchSize, maxBatchSize)
	case c.Workers > maxWorkers:
		return c, fmt.Errorf("outbox relay config: Workers %d: at most %d", c.Workers, maxWorkers)
	case c.ListenKeepalive < minListenKeepalive:
		return c, fmt.Errorf("outbox relay config: ListenKeepalive %v: at least %v", c.ListenKeepalive, minListenKeepalive)
	case c.PollInterval < minPollInterval:
		return c, fmt.Errorf("outbox relay config: PollInterval %v: at least %v", c.PollInterval, minPollInterval)
	case c.Lease < 2*time.Millisecond:
		return c, fmt.Errorf("outbox relay config: Lease %v: too short", c.Lease)
	case c.PublishTimeout > c.Lease/2:
		return c, fmt.Errorf("outbox relay config: PublishTimeout %v must be at most half the Lease %v, so a batch is marked before its lease ends", c.PublishTimeout, c.Lease)
	case c.RetryBackoffMin > c.RetryBackoffMax:
		return c, fmt.Errorf("outbox relay config: RetryBackoffMin %v exceeds RetryBackoffMax %v", c.RetryBackoffMin, c.RetryBackoffMax)
	case c.VacuumEvery < -1:
		return c, fmt.Errorf("outbox relay config: VacuumEvery %d: want -1 (never), 0 (auto) or a number of rows", c.VacuumEvery)
	case c.PurgeBatchSize > outboxsql.MaxPurgeBatch:
		return c, fmt.Errorf("outbox relay config: PurgeBatchSize %d: at most %d", c.PurgeBatchSize, outboxsql.MaxPurgeBatch)
	case strings.ContainsRune(c.NotifyChannel, 0) || len(c.NotifyChannel) > 63:
		return c, fmt.Errorf("outbox relay config: NotifyChannel %q: must be at most 63 bytes without NUL", c.NotifyChannel)
	}
	return c, nil
}

// batchSender is the part of *pgxpool.Pool a mark needs besides DB.
type batchSender interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Relay publishes the outbox's rows through a Publisher. Any number of relays,
// in any number of processes, may run against one database at once.
type Relay struct {
	pool    *pgxpool.Pool
	pub     Publisher
	cfg     RelayConfig
	log     *slog.Logger
	wake    chan struct{}
	running atomic.Bool

	claimBytes int64 // a worker's share of MaxInFlightBytes
	// solo is held shared by every claim in flight, and exclusively by a
	// claim that may take a suspect row alone (see runBatch).
	solo sync.RWMutex
	// handedOverOnly restricts the claim to rows handed over by a WAL relay
	// (relayhook.HandOver).
	handedOverOnly bool

	vacuumer *vacuum.Vacuumer // counts the rows moved out of outbox, and vacuums it (VacuumEvery)
}

// NewRelay returns a relay that publishes the outbox in pool's database (in the
// schema of its search_path) through pub. It validates cfg and does not touch
// the database or the broker: Run does.
func NewRelay(pool *pgxpool.Pool, pub Publisher, cfg RelayConfig) (*Relay, error) {
	if pool == nil {
		return nil, errors.New("outbox relay: nil pool")
	}
	if pub == nil {
		return nil, errors.New("outbox relay: nil publisher")
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	_, handedOverOnly := pub.(relayhook.HandOver)
	claimBytes := int64(math.MaxInt64)
	if cfg.MaxInFlightBytes > 0 {
		claimBytes = max(1, cfg.MaxInFlightBytes/int64(cfg.Workers))
	}
	return &Relay{
		pool:           pool,
		pub:            pub,
		cfg:            cfg,
		claimBytes:     claimBytes,
		handedOverOnly: handedOverOnly,
		log:            cfg.Logger,
		wake:           make(chan struct{}, 1),
		vacuumer:       vacuum.New(pool, cfg.Logger, "outbox relay", cfg.VacuumEvery),
	}, nil
}

// Wake tells the relay that rows were just committed, so it claims now instead
// of at its next tick. Call it after committing a transaction that enqueued. It
// never blocks and coalesces with other wake-ups; one sent while the relay is
// not running is kept for its next Run.
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Run publishes until ctx is cancelled, then finishes the batches in flight
// (publish within PublishTimeout, then mark) and returns nil. Broker and
// database outages do not make it return: it logs, backs off and resumes, and
// the outbox drains after recovery. It returns an error only when called while
// already running.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("outbox relay: Run called while already running")
	}
	defer r.running.Store(false)

	ticker := time.NewTicker(r.cfg.PollInterval)
	defer ticker.Stop()

	var wg sync.WaitGroup
	for range r.cfg.Workers {
		wg.Go(func() { r.work(ctx, ticker.C) })
	}
	if r.cfg.NotifyChannel != "" {
		wg.Go(func() { r.listen(ctx) })
	}
	if r.cfg.PublishedRetention > 0 {
		wg.Go(func() { r.purge(ctx) })
	}
	if r.cfg.VacuumEvery >= 0 {
		wg.Go(func() { r.vacuumer.Run(ctx) })
	}
	r.Wake()
	r.log.InfoContext(ctx, "outbox relay started",
		slog.Int("workers", r.cfg.Workers), slog.Int("batch_size", r.cfg.BatchSize),
		slog.String("notify_channel", r.cfg.NotifyChannel))
	wg.Wait()
	r.log.InfoContext(context.WithoutCancel(ctx), "outbox relay stopped")
	return nil
}

// work is one worker: it waits for a reason to look, then claims and publishes
// batches until there is nothing due.
func (r *Relay) work(ctx context.Context, tick <-chan time.Time) {
	var dbFailures int
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-tick:
		}
		for ctx.Err() == nil {
			if err := r.pub.WaitReady(ctx); err != nil {
				if ctx.Err() == nil {
					r.log.ErrorContext(ctx, "outbox relay: publisher unavailable", slog.Any("error", err))
					retry.Sleep(ctx, r.cfg.PollInterval)
				}
				break
			}
			res, err := r.runBatch(ctx)
			if err != nil {
				// Retry after a backoff rather than wait for the next tick: the
				// wake-up that brought us here may be the only one for a while.
				observe(ctx, r.cfg.Observer, Observation{Kind: KindClaimFailed})
				dbFailures++
				wait := retry.Jitter(retry.Backoff(dbFailures, 100*time.Millisecond, 5*time.Second))
				r.log.ErrorContext(ctx, "outbox relay: claim failed, retrying", slog.Any("error", err), slog.Duration("retry_in", wait))
				retry.Sleep(ctx, wait)
				continue
			}
			dbFailures = 0
			if res.Claimed == 0 && len(res.DeadLetteredAtClaim) == 0 {
				break
			}
			if res.Claimed == r.cfg.BatchSize {
				r.Wake() // more is likely due: let a sibling claim it in parallel
			}
			if len(res.NotSent) == res.Claimed {
				// The publisher said ready but sent nothing: do not spin.
				retry.Sleep(ctx, min(r.cfg.PollInterval, 100*time.Millisecond))
			}
		}
	}
}

// runBatch claims, publishes and marks one batch. It returns an error only when
// the claim failed; failures after it are in the result.
//
// A suspect row (see claimSQL) goes out alone in the process, not only in its
// batch: a claim that may take one holds solo exclusively, from the claim to
// the mark, while every other claim holds it shared. Were another worker's
// rows in flight beside it, the crash it may cause would charge them an
// attempt each time, and dead-letter healthy events.
func (r *Relay) runBatch(ctx context.Context) (batchResult, error) {
	r.solo.RLock()
	res, aloneDue, err := r.claimAndPublish(ctx, false)
	r.solo.RUnlock()
	if err != nil || !aloneDue {
		return res, err
	}
	// Not deferred: should publishing the row panic, the lock stays held
	// while the panic unwinds, and no other worker claims rows that the
	// process is about to take down with it.
	r.solo.Lock()
	res, _, err = r.claimAndPublish(ctx, true)
	r.solo.Unlock()
	return res, err
}

// claimAndPublish is runBatch's claim, publish and mark; alone says the
// claim may take a suspect row. aloneDue says it could not take the
// suspect row that is due.
func (r *Relay) claimAndPublish(ctx context.Context, alone bool) (_ batchResult, aloneDue bool, _ error) {
	if ctx.Err() != nil {
		return batchResult{}, false, nil
	}
	// From here on the batch is finished even if ctx is cancelled: abandoning
	// confirmed messages unmarked would only publish them again.
	detached := context.WithoutCancel(ctx)
	start := time.Now()

	cctx, cancel := context.WithTimeout(detached, dbTimeout)
	c, err := claim(cctx, r.pool, r.cfg.BatchSize, r.claimBytes, r.cfg.Lease, r.cfg.MaxAttempts, r.handedOverOnly, alone)
	cancel()
	if err != nil {
		return batchResult{}, false, err
	}
	envs, dead := c.envs, c.dead
	res := batchResult{Claimed: len(envs)}
	for _, d := range dead {
		res.DeadLetteredAtClaim = append(res.DeadLetteredAtClaim, d.env.ID)
		r.log.ErrorContext(ctx, "outbox event dead-lettered at claim: its relays stopped while publishing it",
			append(d.env.logAttrs(), slog.String("reason", d.reason))...)
	}
	r.count(ctx, KindDeadLettered, len(dead))
	if len(envs) == 0 {
		if len(dead) > 0 {
			r.batchDone(ctx, res)
		}
		return res, c.aloneDue, nil
	}
	sortRuns(envs)
	if mutantRelayReorder {
		slices.Reverse(envs) // a planted bug: see mutant_relay_reorder.go
	}
	leaseEnd := start.Add(r.cfg.Lease)
	if mutantRelayMarkFirst {
		// A planted bug (mutant_relay_markfirst.go): the mark first, then
		// the publish, whose verdicts go unread.
		res.Published, res.Unmarked, res.Err = r.mark(detached, envs, leaseEnd)
		pctx, cancel := context.WithTimeout(detached, r.cfg.PublishTimeout)
		r.pub.PublishBatch(pctx, envs)
		cancel()
		r.confirmed(ctx, envs)
		r.batchDone(ctx, res)
		return res, false, nil
	}

	pctx, cancel := context.WithTimeout(detached, r.cfg.PublishTimeout)
	pubStart := time.Now()
	results := r.pub.PublishBatch(pctx, envs)
	cancel()
	observe(ctx, r.cfg.Observer, Observation{Kind: KindConfirmLatency, Duration: time.Since(pubStart)})
	if len(results) != len(envs) {
		err := fmt.Errorf("outbox relay: publisher returned %d results for %d messages", len(results), len(envs))
		results = make([]error, len(envs))
		for i := range results {
			results[i] = err
		}
	}

	var confirmed []Envelope
	var failures []failure
	// failedBefore holds, per aggregate, the first of its events in this
	// batch without a confirm: the ones after it are not marked.
	var failedBefore map[aggregateKey]Envelope
	for i, e := range envs {
		perr := results[i]
		if first, ok := failedBefore[keyOf(e)]; ok && !errors.Is(perr, ErrBatchRefused) {
			// An earlier event of its run failed: whatever the broker said of
			// this one, marking it would put it before that event. It goes
			// again after it, its attempt given back (it did nothing wrong).
			failures = append(failures, failure{env: e, refund: true, behind: true,
				err: errorText(fmt.Errorf("sent after event %d of its aggregate (version %d), which failed: %w", first.ID, first.AggregateVersion, cmp.Or(perr, errConfirmedBehind)))})
			continue
		}
		if perr == nil {
			confirmed = append(confirmed, e)
			continue
		}
		if failedBefore == nil {
			failedBefore = map[aggregateKey]Envelope{}
		}
		if _, ok := failedBefore[keyOf(e)]; !ok {
			failedBefore[keyOf(e)] = e
		}
		f := failure{env: e, err: errorText(perr), unroutable: errors.Is(perr, ErrUnroutable)}
		refused := errors.Is(perr, ErrBatchRefused)
		switch {
		case errors.Is(perr, ErrNotSent):
			f.refund = true
		case refused && len(envs) > 1:
			// Any of the batch's messages without a verdict may be the one the
			// broker refused: each goes out alone, at no attempt's cost.
			f.refund, f.suspect, f.isolate = true, true, true
		case e.Attempt >= r.cfg.MaxAttempts:
			f.dead, f.suspect = true, refused
		default:
			// Refused alone, it is the one: it stays alone, and its attempts count.
			f.suspect = refused
			f.delay = retry.Jitter(retry.Backoff(e.Attempt, r.cfg.RetryBackoffMin, r.cfg.RetryBackoffMax))
		}
		failures = append(failures, f)
	}

	// Failures first: a mark can take a while when writers hold aggregates.
	if len(failures) > 0 {
		r.recordFailures(detached, failures, &res)
	}
	if len(confirmed) > 0 {
		r.confirmed(ctx, confirmed)
		marked, unmarked, err := r.mark(detached, confirmed, leaseEnd)
		res.Published, res.Unmarked = marked, unmarked
		r.count(ctx, KindUnmarked, len(unmarked))
		r.vacuumer.Counted(len(marked))
		res.Err = errors.Join(res.Err, err)
		r.count(ctx, KindPublished, len(confirmed))
		if r.log.Enabled(ctx, slog.LevelDebug) {
			isMarked := make(map[int64]bool, len(marked))
			for _, id := range marked {
				isMarked[id] = true
			}
			for _, e := range confirmed {
				if isMarked[e.ID] {
					r.log.DebugContext(ctx, "outbox event published", e.logAttrs()...)
				}
			}
		}
	}

	observe(ctx, r.cfg.Observer, Observation{Kind: KindBatchDuration, Duration: time.Since(start)})
	r.batchDone(ctx, res)
	return res, false, nil
}

// confirmed tells a relayhook.Confirmed observer the rows the broker
// confirmed, before the mark.
func (r *Relay) confirmed(ctx context.Context, envs []Envelope) {
	if h, ok := r.cfg.Observer.(relayhook.Confirmed); ok {
		ids := ids(envs)
		slices.Sort(ids)
		h.Confirmed(ctx, ids)
	}
}

// batchDone tells a relayhook.BatchDone observer the batch's outcome.
func (r *Relay) batchDone(ctx context.Context, res batchResult) {
	if h, ok := r.cfg.Observer.(relayhook.BatchDone); ok {
		for _, s := range [][]int64{res.Published, res.Unmarked, res.Failed, res.DeadLettered, res.NotSent, res.Isolated, res.Behind, res.DeadLetteredAtClaim} {
			slices.Sort(s)
		}
		h.BatchDone(ctx, res)
	}
}

// count reports n rows of kind k, when there are any.
func (r *Relay) count(ctx context.Context, k ObservationKind, n int) {
	if n > 0 {
		observe(ctx, r.cfg.Observer, Observation{Kind: k, N: n})
	}
}

// mark marks confirmed rows published. Rows whose aggregate a writer holds are
// retried with a short backoff while the lease leaves time; what remains
// unmarked is published again after the lease (a duplicate, never a loss).
func (r *Relay) mark(ctx context.Context, confirmed []Envelope, leaseEnd time.Time) (marked, unmarked []int64, err error) {
	pending := confirmed
	for try := 1; ; try++ {
		mctx, cancel := context.WithTimeout(ctx, dbTimeout)
		deferred, merr := markPublished(mctx, r.pool, pending)
		cancel()
		err = merr
		if merr != nil {
			observe(ctx, r.cfg.Observer, Observation{Kind: KindMarkFailed})
			deferred = pending
		} else {
			left := make(map[int64]bool, len(deferred))
			for _, e := range deferred {
				left[e.ID] = true
			}
			for _, e := range pending {
				if !left[e.ID] {
					marked = append(marked, e.ID)
				}
			}
		}
		pending = deferred
		if len(pending) == 0 {
			return marked, nil, nil
		}
		wait := retry.Jitter(retry.Backoff(try, 5*time.Millisecond, 500*time.Millisecond))
		if time.Until(leaseEnd) < r.cfg.Lease/4+wait {
			if err == nil {
				err = fmt.Errorf("mark outbox rows published: %d rows still locked by the writers of their aggregates' next events", len(pending))
			}
			for _, e := range pending {
				r.log.WarnContext(ctx, "outbox event published but not marked: it will be published again",
					append(e.logAttrs(), slog.Any("error", err))...)
			}
			// The relay knows what became of these rows: the broker took
			// them. They are not the orphans of a crash, whose rows count as
			// in flight at a stop (see claimSQL). Best effort: if the
			// database is what failed, they are.
			rctx, cancel := context.WithTimeout(ctx, dbTimeout)
			if rerr := releaseUnmarked(rctx, r.pool, pending); rerr != nil {
				observe(ctx, r.cfg.Observer, Observation{Kind: KindMarkFailed})
				err = errors.Join(err, rerr)
				r.log.WarnContext(ctx, "outbox relay: could not record unmarked rows (they stay in flight: retried after their lease, as after a crash)",
					slog.Any("error", rerr), slog.Int("rows", len(pending)))
			}
			cancel()
			return marked, ids(pending), err
		}
		if merr != nil {
			r.log.WarnContext(ctx, "outbox relay: mark failed, retrying", slog.Any("error", merr), slog.Int("rows", len(pending)))
		}
		retry.Sleep(ctx, wait)
	}
}

func (r *Relay) recordFailures(ctx context.Context, failures []failure, res *batchResult) {
	fctx, cancel := context.WithTimeout(ctx, dbTimeout)
	updated, err := recordFailures(fctx, r.pool, failures)
	cancel()
	if err != nil {
		// The rows stay leased: they are retried when the lease ends, with this
		// attempt counted.
		res.Err = errors.Join(res.Err, err)
		observe(ctx, r.cfg.Observer, Observation{Kind: KindMarkFailed})
		r.log.ErrorContext(ctx, "outbox relay: could not record failed publishes", slog.Any("error", err), slog.Int("rows", len(failures)))
	}
	var failed, returned, dead int
	for _, f := range failures {
		attrs := append(f.env.logAttrs(), slog.String("error", f.err))
		switch {
		case f.behind:
			res.Behind = append(res.Behind, f.env.ID)
			r.log.DebugContext(ctx, "outbox event not marked: an earlier event of its aggregate in the batch failed; it goes again after it", attrs...)
		case f.isolate:
			res.Isolated = append(res.Isolated, f.env.ID)
			r.log.WarnContext(ctx, "outbox event in a batch the broker refused (it did not say which message): retrying it alone", attrs...)
			failed++
		case f.refund:
			res.NotSent = append(res.NotSent, f.env.ID)
			r.log.DebugContext(ctx, "outbox event not sent, retrying", attrs...)
		case f.dead:
			if !updated[f.env.ID] {
				continue
			}
			res.DeadLettered = append(res.DeadLettered, f.env.ID)
			r.log.ErrorContext(ctx, "outbox event dead-lettered after its last attempt", attrs...)
			failed++
			dead++
		default:
			res.Failed = append(res.Failed, f.env.ID)
			r.log.WarnContext(ctx, "outbox event publish failed, will retry", append(attrs, slog.Duration("retry_in", f.delay))...)
			failed++
		}
		if f.unroutable {
			returned++
		}
	}
	r.count(ctx, KindFailed, failed)
	r.count(ctx, KindReturned, returned)
	r.count(ctx, KindDeadLettered, dead)
}

// errConfirmedBehind is the outcome of a confirmed event that is not marked
// because an earlier event of its aggregate in the batch failed.
var errConfirmedBehind = errors.New("confirmed, not marked")

// aggregateKey names an aggregate.
type aggregateKey struct{ typ, id string }

func keyOf(e Envelope) aggregateKey { return aggregateKey{e.AggregateType, e.AggregateID} }

// sortRuns orders a claimed batch for the publisher: the events of one
// aggregate in version order (a run, see claimSQL), the aggregates by their
// first event's id. Each envelope's key is computed once: the comparisons
// of a sort must not hash strings.
func sortRuns(envs []Envelope) {
	first := make(map[aggregateKey]int64, len(envs))
	for _, e := range envs {
		if id, ok := first[keyOf(e)]; !ok || e.ID < id {
			first[keyOf(e)] = e.ID
		}
	}
	type keyed struct {
		first, version int64
		e              Envelope
	}
	ks := make([]keyed, len(envs))
	for i, e := range envs {
		ks[i] = keyed{first[keyOf(e)], e.AggregateVersion, e}
	}
	slices.SortFunc(ks, func(a, b keyed) int {
		return cmp.Or(cmp.Compare(a.first, b.first), cmp.Compare(a.version, b.version))
	})
	for i, k := range ks {
		envs[i] = k.e
	}
}

// errorText makes err storable as last_error.
func errorText(err error) string { return outboxsql.ErrorText(err.Error()) }

package audit

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// Done is what an incremental audit asks the consumer of one message:
// pkg/inbox's Inbox.IsDone, a look-up by _id (the one filter FerretDB
// pushes down to its storage).
type Done interface {
	IsDone(ctx context.Context, msgID string) (bool, error)
}

// Tallies is what the consumer's inbox counted of its records per bucket of
// creation times: pkg/inbox's Inbox with TallyBucket.
type Tallies interface {
	TallyBucket() time.Duration
	Tallies(ctx context.Context, buckets []time.Time) ([]inbox.Tally, error)
}

var (
	_ Done    = (*inbox.Inbox)(nil)
	_ Tallies = (*inbox.Inbox)(nil)
)

// Defaults of IncrementalConfig.
const (
	// DefaultBucket is the width of the creation-time buckets an
	// incremental audit counts in, and the granularity of its window.
	DefaultBucket = time.Minute
	// DefaultCommitLag is how long after its created_at (its transaction's
	// start) an event may still commit.
	DefaultCommitLag = time.Minute
	// DefaultFullEvery is how often an incremental audit runs a full one.
	DefaultFullEvery = 6 * time.Hour
	// DefaultLookups is how many Done look-ups run at once.
	DefaultLookups = 16
)

// IncrementalConfig configures an Incremental audit.
type IncrementalConfig struct {
	// Config is what a full audit runs with (Since, Until, Now and Observe
	// are each cycle's own).
	Config
	// Done looks the events not recorded yet up by message id. Required.
	Done Done
	// Tallies, when set, is read first: the open events of a bucket whose
	// tally agrees with the outbox's (as many records, the same digest)
	// are recorded, and only those of the other buckets are looked up by
	// id. Its TallyBucket is the Bucket (Bucket, when set, must equal it).
	Tallies Tallies
	// Bucket, CommitLag, FullEvery, Lookups: defaults DefaultBucket,
	// DefaultCommitLag, DefaultFullEvery, DefaultLookups.
	Bucket, CommitLag, FullEvery time.Duration
	Lookups                      int
	// Retention, when set, is how long the outbox keeps published events:
	// a full audit's Horizon is its now - Retention + ClockSkew.
	Retention time.Duration
}

// tally is what an incremental audit keeps of one bucket of creation
// times: how many events the outbox committed in it and how many of them
// the inbox recorded, and a digest of each side's message ids (a sum of
// their hashes). The two digests agree when every event of the bucket is
// recorded; the events of a bucket where they do not are held by id
// (Incremental.open), and their hashes make up the difference.
type tally struct {
	events, recorded       int64
	eventDigest, recDigest inbox.Digest
}

// Incremental audits a flow again and again, each cycle reading only what
// changed since the last: the outbox's events above a watermark (a range of
// its primary key) and, by message id, the events the inbox had not
// recorded yet. Its state is a tally per bucket of creation times and the
// events not recorded yet; memory holds those and the ids of the last few
// minutes' events, whatever the history holds.
//
// Its first cycle, one every FullEvery, and one right after the outbox lost
// an event it had counted (a failover) are full audits (Run). A full audit
// alone finds phantoms (inbox records of no event: they are only found by
// reading the whole inbox) and applied_before_window; the cycles between
// carry the last full audit's. An event committed more than CommitLag after
// its created_at, below the watermark, is seen by the next full audit only.
type Incremental struct {
	cfg       IncrementalConfig
	buckets   map[int64]*tally
	open      map[int64]outboxaudit.LoggedEvent // judged, not recorded yet
	tail      map[int64]time.Time               // the events above the watermark: their creation times
	watermark int64
	full      *Report // the last full audit
	fullAt    time.Time
	refull    bool
}

// NewIncremental returns an incremental audit.
func NewIncremental(cfg IncrementalConfig) (*Incremental, error) {
	if cfg.Done == nil || cfg.Bucket < 0 || cfg.CommitLag < 0 || cfg.FullEvery < 0 || cfg.Lookups < 0 || cfg.Retention < 0 {
		return nil, errors.New("audit: incremental: Done is required; Bucket, CommitLag, FullEvery, Lookups, Retention must not be negative")
	}
	if cfg.Tallies != nil {
		width := cfg.Tallies.TallyBucket()
		if width <= 0 || cfg.Bucket != 0 && cfg.Bucket != width {
			return nil, fmt.Errorf("audit: incremental: the consumer's tallies are %v wide, Bucket %v: want tallies (inbox.Config.TallyBucket), as wide as the buckets", width, cfg.Bucket)
		}
		cfg.Bucket = width
	}
	cfg.Bucket = cmp.Or(cfg.Bucket, DefaultBucket)
	cfg.CommitLag = cmp.Or(cfg.CommitLag, DefaultCommitLag)
	cfg.FullEvery = cmp.Or(cfg.FullEvery, DefaultFullEvery)
	cfg.Lookups = cmp.Or(cfg.Lookups, DefaultLookups)
	return &Incremental{cfg: cfg}, nil
}

func (in *Incremental) bucket(t time.Time) int64 {
	return t.UnixNano() / int64(in.cfg.Bucket)
}

// count adds e to its bucket, as committed, and as recorded when recorded.
func (in *Incremental) count(e outboxaudit.LoggedEvent, recorded bool) {
	k := in.bucket(e.CreatedAt)
	t := in.buckets[k]
	if t == nil {
		t = &tally{}
		in.buckets[k] = t
	}
	h := inbox.DigestOf(e.MessageID())
	t.events++
	t.eventDigest = t.eventDigest.Plus(h)
	if recorded {
		t.recorded++
		t.recDigest = t.recDigest.Plus(h)
	}
}

// recorded counts an open event as recorded.
func (in *Incremental) recorded(e outboxaudit.LoggedEvent) {
	t := in.buckets[in.bucket(e.CreatedAt)]
	t.recorded++
	t.recDigest = t.recDigest.Plus(inbox.DigestOf(e.MessageID()))
	delete(in.open, e.ID)
}

// Cycle audits [since, until) at now, both bounds rounded up to whole
// buckets (Report.Since and Until say which): the events of the bucket that
// holds until are judged (so "until now" includes the last events), and a
// bucket that holds since, which the full audit read in part, is not.
func (in *Incremental) Cycle(ctx context.Context, since, until, now time.Time) (*Report, error) {
	start := time.Now()
	if in.full == nil || in.refull || now.Sub(in.fullAt) >= in.cfg.FullEvery {
		if err := in.fullAudit(ctx, since, now); err != nil {
			return nil, err
		}
	} else if err := in.step(ctx, now, in.after(until)); err != nil {
		return nil, err
	} else if in.refull {
		if err := in.fullAudit(ctx, since, now); err != nil {
			return nil, err
		}
	}
	r, err := in.report(ctx, since, until, now)
	if err != nil {
		return nil, err
	}
	r.Seconds = time.Since(start).Seconds()
	return r, nil
}

// cutoff is the creation time before which every event has committed.
func (in *Incremental) cutoff(now time.Time) time.Time {
	return now.Add(-2*in.cfg.CommitLag - cmp.Or(in.cfg.ClockSkew, DefaultClockSkew))
}

// fullAudit rebuilds the state from a full audit of the events created from
// since on.
func (in *Incremental) fullAudit(ctx context.Context, since, now time.Time) error {
	in.buckets, in.open, in.tail, in.watermark = map[int64]*tally{}, map[int64]outboxaudit.LoggedEvent{}, map[int64]time.Time{}, 0
	cutoff := in.cutoff(now)
	cfg := in.cfg.Config
	// Until past every event: all are judged; each cycle's report takes
	// its own window from the buckets.
	cfg.Since, cfg.Until, cfg.Now = since, now.Add(24*time.Hour), now
	if in.cfg.Retention > 0 {
		cfg.Horizon = now.Add(-in.cfg.Retention + cmp.Or(cfg.ClockSkew, DefaultClockSkew))
	}
	cfg.Observe = func(e outboxaudit.LoggedEvent, recorded bool) {
		in.count(e, recorded)
		if !recorded {
			in.open[e.ID] = e
		}
		if e.CreatedAt.Before(cutoff) {
			in.watermark = max(in.watermark, e.ID)
		} else {
			in.tail[e.ID] = e.CreatedAt
		}
	}
	r, err := Run(ctx, cfg)
	if err != nil {
		in.full = nil
		return err
	}
	in.full, in.fullAt, in.refull = r, now, false
	in.prune()
	return nil
}

// prune drops the ids at or below the watermark from the tail.
func (in *Incremental) prune() {
	for id := range in.tail {
		if id <= in.watermark {
			delete(in.tail, id)
		}
	}
}

// after is the first bucket after until: its events are not judged.
func (in *Incremental) after(until time.Time) int64 {
	return (until.UnixNano() + int64(in.cfg.Bucket) - 1) / int64(in.cfg.Bucket)
}

// step reads what changed since the last cycle; of the open events, those
// of buckets before last are looked up by id when their tallies disagree.
func (in *Incremental) step(ctx context.Context, now time.Time, last int64) error {
	cutoff := in.cutoff(now)
	seen, added := 0, 0
	fresh := map[int64]bool{} // events read in this scan: their state is current
	watermark := in.watermark
	for e, err := range in.cfg.Producer.Events(ctx, outboxaudit.EventWindow{MinID: in.watermark + 1}) {
		if err != nil {
			return fmt.Errorf("audit: incremental: read the outbox above id %d: %w", in.watermark, err)
		}
		if e.CreatedAt.Before(cutoff) {
			watermark = max(watermark, e.ID)
		}
		if created, ok := in.tail[e.ID]; ok {
			if !created.Equal(e.CreatedAt) {
				in.refull = true // another event under a counted id
			}
			seen++
			if _, ok := in.open[e.ID]; ok {
				in.open[e.ID] = e
				fresh[e.ID] = true
			}
			continue
		}
		added++
		in.count(e, false)
		in.tail[e.ID] = e.CreatedAt
		in.open[e.ID] = e
		fresh[e.ID] = true
	}
	if seen < len(in.tail)-added || in.refull {
		// The outbox no longer holds events it had: a failover lost them,
		// and may hand their ids out again below the watermark.
		in.refull = true
		return nil
	}
	// The state of the older open events, then whether the inbox recorded
	// any open event by now.
	var stale []int64
	for id := range in.open {
		if !fresh[id] {
			stale = append(stale, id)
		}
	}
	batch := cmp.Or(in.cfg.LookupBatch, DefaultLookupBatch)
	for i := 0; i < len(stale); i += batch {
		found, err := in.cfg.Producer.Lookup(ctx, stale[i:min(i+batch, len(stale))])
		if err != nil {
			return fmt.Errorf("audit: incremental: look up %d open events: %w", len(stale[i:min(i+batch, len(stale))]), err)
		}
		for _, e := range found {
			if o, ok := in.open[e.ID]; ok && e.CreatedAt.Equal(o.CreatedAt) {
				in.open[e.ID] = e
			}
		}
	}
	if err := in.lookUpOpen(ctx, last); err != nil {
		return err
	}
	in.watermark = watermark
	in.prune()
	return nil
}

// lookUpOpen finds which open events the inbox recorded by now: those of
// the buckets whose tallies agree (Tallies), then the others of the buckets
// before last (those a report judges) by asking Done about each, Lookups at
// a time. With tallies, a younger event is left for a later cycle, when its
// bucket's tally agrees or it is judged: a live flow's events in flight
// cost no look-ups by id.
func (in *Incremental) lookUpOpen(ctx context.Context, last int64) error {
	if err := in.tallied(ctx); err != nil {
		return err
	}
	events := make([]outboxaudit.LoggedEvent, 0, len(in.open))
	for _, e := range in.open {
		if in.cfg.Tallies != nil && in.bucket(e.CreatedAt) >= last {
			continue
		}
		events = append(events, e)
	}
	done := make([]bool, len(events))
	errs := make([]error, in.cfg.Lookups)
	var wg sync.WaitGroup
	for w := range in.cfg.Lookups {
		wg.Go(func() {
			for i := w; i < len(events); i += in.cfg.Lookups {
				ok, err := in.cfg.Done.IsDone(ctx, events[i].MessageID())
				if err != nil {
					errs[w] = fmt.Errorf("audit: incremental: look up %s in the inbox: %w", events[i].MessageID(), err)
					return
				}
				done[i] = ok
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for i, e := range events {
		if done[i] {
			in.recorded(e)
		}
	}
	return nil
}

// tallied reads the tallies of the buckets that hold open events, and
// counts the open events of each bucket whose tally agrees with the
// outbox's count and digest as recorded: the inbox holds a record of each
// event of the bucket. (A tally is never ahead of its records; one that
// disagrees, or is missing, leaves its events to Done.)
func (in *Incremental) tallied(ctx context.Context) error {
	if in.cfg.Tallies == nil || len(in.open) == 0 {
		return nil
	}
	byBucket := map[int64][]outboxaudit.LoggedEvent{}
	for _, e := range in.open {
		k := in.bucket(e.CreatedAt)
		byBucket[k] = append(byBucket[k], e)
	}
	keys := slices.Sorted(maps.Keys(byBucket))
	starts := make([]time.Time, len(keys))
	for i, k := range keys {
		starts[i] = time.Unix(0, k*int64(in.cfg.Bucket)).UTC()
	}
	tallies, err := in.cfg.Tallies.Tallies(ctx, starts)
	if err != nil {
		return fmt.Errorf("audit: incremental: read the inbox's tallies of %d buckets: %w", len(starts), err)
	}
	for i, k := range keys {
		t := in.buckets[k]
		if t == nil || tallies[i].Count != t.events || tallies[i].Digest != t.eventDigest {
			continue
		}
		for _, e := range byBucket[k] {
			in.recorded(e)
		}
	}
	return nil
}

// report builds a report of [since, until), rounded up to whole buckets,
// from the tallies and the open events; it drops what is older than since.
func (in *Incremental) report(ctx context.Context, since, until, now time.Time) (*Report, error) {
	cfg, err := in.cfg.Config.withDefaults0(since, until, now)
	if err != nil {
		return nil, err
	}
	first := (since.UnixNano() + int64(in.cfg.Bucket) - 1) / int64(in.cfg.Bucket) // the first whole bucket
	last := in.after(until)                                                       // the first bucket after until
	r := &Report{Since: time.Unix(0, first*int64(in.cfg.Bucket)).UTC(), Until: time.Unix(0, last*int64(in.cfg.Bucket)).UTC(),
		Grace: cfg.Grace.String(), AuditedAt: now}
	for _, b := range r.Buckets() {
		b.Examples = []string{}
	}
	r.Phantom, r.AppliedBeforeWindow, r.InboxRecords = in.full.Phantom, in.full.AppliedBeforeWindow, in.full.InboxRecords
	// Each bucket's digests must differ by the open events' hashes.
	diff := map[int64]inbox.Digest{}
	n := map[int64]int64{}
	for id, e := range in.open {
		k := in.bucket(e.CreatedAt)
		if k < first {
			delete(in.open, id)
			continue
		}
		diff[k] = diff[k].Plus(inbox.DigestOf(e.MessageID()))
		n[k]++
	}
	for k, t := range in.buckets {
		if k < first {
			delete(in.buckets, k)
			continue
		}
		if t.events-t.recorded != n[k] || t.eventDigest.Minus(t.recDigest) != diff[k] {
			return nil, fmt.Errorf("audit: incremental: bucket %s: %d events, %d recorded, %d open: the digests disagree by more than the open events", time.Unix(0, k*int64(in.cfg.Bucket)).UTC(), t.events, t.recorded, n[k])
		}
		if k < last {
			r.Checked += t.events
			r.Applied.Count += t.recorded
		}
	}
	a := &auditor{cfg: cfg, r: r, keys: map[int64]string{}, stale: now.Add(-cfg.Grace)}
	for _, e := range in.open {
		if k := in.bucket(e.CreatedAt); k >= last {
			continue
		}
		switch e.State {
		case outbox.EventDeadLettered:
			a.add(&r.DeadLettered, e.MessageID())
		case outbox.EventDiscarded:
			a.add(&r.Discarded, e.MessageID())
		default:
			if cfg.Accountant == nil {
				a.unaccounted(e, e.MessageID())
				continue
			}
			a.unapplied = append(a.unapplied, e)
			a.keys[e.ID] = e.MessageID()
			if len(a.unapplied) >= cfg.LookupBatch {
				if err := a.account(ctx); err != nil {
					return nil, err
				}
			}
		}
	}
	if cfg.Accountant != nil {
		if err := a.account(ctx); err != nil {
			return nil, err
		}
	}
	return r, nil
}

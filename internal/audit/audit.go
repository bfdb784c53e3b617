// Package audit compares what a producer committed with what a consumer
// applied, from their stores: the events of an outbox (pkg/outbox's
// EventLog) against the done records of an inbox (pkg/inbox's Recorded),
// and tells, for a window of creation times, which events were applied,
// which are missing, which inbox records have no committed event
// (phantoms), and which events are pending, dead-lettered or discarded.
//
// Both sides are read as streams, in pages, in the same order, and merged:
// memory holds a page of each side, a batch of look-ups and a few example
// ids, however many events the window holds. Each stream is read ahead, a
// few batches, in a goroutine of its own (Config.Prefetch): the two stores
// work at the same time, and while the merge runs. The inbox keeps message ids as
// strings and yields them in byte order ("10-..." before "9-..."); an event's
// message id is its outbox id in decimal, a '-' and its creation time
// (outbox.MessageID), whose byte order agrees with the ids' numeric order
// among ids of the same number of digits, so the producer side is read as
// one stream per number of digits, merged by byte order.
//
// What each bucket means, for an event created in [Since, Until):
//
//   - applied: the inbox recorded it as done (whatever the outbox says of
//     it: a confirm lost, or a mark not written yet, leaves it pending there).
//   - unrecorded: no inbox record, but the consumer holds its effect
//     (Accountant): a record buffered in memory when the consumer died after
//     its ack, or expired.
//   - held: no inbox record, and the consumer keeps the message for an
//     operator (Accountant): dead-lettered, parked behind a dead letter, or
//     discarded on the consumer's side.
//   - dead_lettered, discarded: not in the inbox, and the outbox says the
//     event is dead-lettered, or was discarded by an operator: it never left,
//     knowingly.
//   - pending: none of the above, and the event is still in flight: its last
//     step (its commit, or its publish) is less than Grace ago.
//   - missing: none of the above, older than that: committed and published,
//     or committed long ago, and not applied.
//   - phantom: an inbox record, processed at or after Since - ClockSkew,
//     whose message id is no event the outbox holds: not an outbox id, or
//     an id the outbox does not hold although the creation time the message
//     id carries is within what it keeps (at or after the Horizon), or an
//     id the outbox holds under another creation time (committed on a
//     primary that a failover lost, its id handed out again since).
//
// And for the inbox records of events created before Since:
//
//   - applied_before_window: an inbox record, processed at or after Since
//   - ClockSkew, of an event created before Since (by the creation time
//     its message id carries): the outbox holds that event, or no longer
//     holds it because it was created before the Horizon (purged by its
//     retention: a dead letter replayed long after it was published). Not
//     judged, not a phantom.
//
// An event is judged by the snapshot each page was read in: one that
// commits, or whose record is written, after the scan went past its id is
// judged by the next audit.
//
// Run reads the whole window of both stores. Incremental audits again and
// again at the cost of what changed: a full audit (Run) now and then, and
// between them the outbox's new events and, by message id, the events the
// inbox had not recorded yet, counted per bucket of creation times (see
// Incremental for what its cycles cannot see).
package audit

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"iter"
	"math"
	"slices"
	"time"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
)

// Producer is what the audit reads of the producer: pkg/outbox's EventLog.
type Producer interface {
	Events(ctx context.Context, w outboxaudit.EventWindow) iter.Seq2[outboxaudit.LoggedEvent, error]
	Lookup(ctx context.Context, ids []int64) ([]outboxaudit.LoggedEvent, error)
}

// Consumer is what the audit reads of the consumer: pkg/inbox's Inbox.
type Consumer interface {
	Recorded(ctx context.Context, since time.Time, pageSize int) iter.Seq2[inbox.RecordedMessage, error]
}

// Kept is what a consumer did with an event its inbox has no record of.
type Kept string

const (
	// KeptEffect: the consumer holds the event's effect (unrecorded).
	KeptEffect Kept = "effect"
	// KeptHeld: the consumer keeps the message for an operator, or its
	// operator discarded it (held).
	KeptHeld Kept = "held"
)

// Accountant tells what the consumer did with events its inbox has no
// record of. Account returns an entry for each event it accounts for.
type Accountant interface {
	Account(ctx context.Context, events []outboxaudit.LoggedEvent) (map[int64]Kept, error)
}

var (
	_ Producer = (*outboxaudit.EventLog)(nil)
	_ Consumer = (*inbox.Inbox)(nil)
)

// Defaults.
const (
	// DeliveryMargin covers what delays an event by design besides the
	// consumer's deferrals: a relay's lease after it died (30s), the
	// relay's retries with backoff, the consumer's attempts before it
	// defers, a redelivery after the last deferral.
	DeliveryMargin = 15 * time.Minute
	// DefaultGrace is GraceFor a consumer that defers a message for up to
	// 30 minutes before it dead-letters it (shipping's default
	// -max-deferral-age): a message still being deferred is on its way,
	// not missing.
	DefaultGrace = 30*time.Minute + DeliveryMargin
	// DefaultClockSkew is how far the consumer's clock (processed_at) may
	// be behind the producer database's (created_at).
	DefaultClockSkew = time.Minute
	DefaultExamples  = 10
	// DefaultLookupBatch is how many ids one look-up carries.
	DefaultLookupBatch = 1000
	// DefaultPrefetch is how many batches a stream reads ahead, and
	// PrefetchBatch how many items a batch holds: the audit holds at most
	// DefaultPrefetch+2 batches of each stream.
	DefaultPrefetch = 4
	PrefetchBatch   = 1000
)

// GraceFor returns the grace for a consumer that keeps deferring a message
// for up to maxDeferral before it dead-letters it (then the event is held,
// or applied): maxDeferral + DeliveryMargin.
func GraceFor(maxDeferral time.Duration) time.Duration { return maxDeferral + DeliveryMargin }

// Config configures an audit.
type Config struct {
	Producer Producer // required
	Consumer Consumer // required
	// Accountant, when set, is asked about the events the inbox has no
	// record of. Default nil: such events are pending or missing.
	Accountant Accountant
	// Since and Until bound the creation times audited: Since <= created_at
	// < Until. Required.
	Since, Until time.Time
	// Grace: an event not applied whose last step is more recent than
	// Now - Grace is pending, not missing. Default DefaultGrace.
	Grace time.Duration
	// Now is the audit's time. Default time.Now().
	Now time.Time
	// Horizon is the creation time from which the producer holds every
	// event it committed (its retention, less a margin): a record of an
	// event created before min(Horizon, Since) that the producer no longer
	// holds is not a phantom. Default Since.
	Horizon time.Time
	// ClockSkew widens the inbox side's window: records processed from
	// Since - ClockSkew on are read. Default DefaultClockSkew.
	ClockSkew time.Duration
	// Examples is how many ids each bucket keeps. Default DefaultExamples;
	// -1 keeps none.
	Examples int
	// InboxPageSize is the Consumer's page size. Default 0: its own.
	InboxPageSize int
	// LookupBatch is how many ids a look-up (Producer.Lookup,
	// Accountant.Account) carries, at most outboxaudit.MaxEventLookup. Default
	// DefaultLookupBatch.
	LookupBatch int
	// Observe, when set, is called with every event the audit judges and
	// whether the inbox recorded it (Incremental builds its state on it).
	Observe func(e outboxaudit.LoggedEvent, recorded bool)
	// Prefetch is how many batches of PrefetchBatch items each stream (the
	// inbox's, and the outbox's one per number of digits) reads ahead, in a
	// goroutine of its own, so that the two stores work at the same time
	// and while the merge runs. Default DefaultPrefetch; -1 reads each
	// stream in the merge's goroutine, one side after the other.
	Prefetch int
}

// Bucket counts the events of one outcome, with the first ids the audit
// found (events in byte order of their ids; phantoms in the order their
// look-ups confirmed them).
type Bucket struct {
	Count    int64    `json:"count"`
	Examples []string `json:"examples"`
}

// Report is the result of an audit. Checked is the sum of the event
// buckets (all but Phantom).
type Report struct {
	Since        time.Time `json:"since"`
	Until        time.Time `json:"until"`
	Grace        string    `json:"grace"`
	AuditedAt    time.Time `json:"audited_at"`
	Seconds      float64   `json:"duration_seconds"`
	Checked      int64     `json:"checked"`
	Applied      Bucket    `json:"applied"`
	Unrecorded   Bucket    `json:"unrecorded"`
	Missing      Bucket    `json:"missing"`
	Phantom      Bucket    `json:"phantom"`
	Pending      Bucket    `json:"pending"`
	DeadLettered Bucket    `json:"dead_lettered"`
	Discarded    Bucket    `json:"discarded"`
	Held         Bucket    `json:"held"`
	// AppliedBeforeWindow counts the inbox records read whose event was
	// created before Since (by the creation time their message id
	// carries): not judged, not phantoms.
	AppliedBeforeWindow Bucket `json:"applied_before_window"`
	// InboxRecords is how many inbox records the audit read.
	InboxRecords int64 `json:"inbox_records"`
}

// Whole reports whether nothing is missing and nothing is a phantom.
func (r *Report) Whole() bool { return r.Missing.Count == 0 && r.Phantom.Count == 0 }

// Buckets returns the buckets by name, as the report's JSON names them.
func (r *Report) Buckets() map[string]*Bucket {
	return map[string]*Bucket{
		"applied": &r.Applied, "unrecorded": &r.Unrecorded, "missing": &r.Missing, "phantom": &r.Phantom,
		"pending": &r.Pending, "dead_lettered": &r.DeadLettered, "discarded": &r.Discarded, "held": &r.Held,
		"applied_before_window": &r.AppliedBeforeWindow,
	}
}

func (c Config) withDefaults() (Config, error) {
	if c.Producer == nil || c.Consumer == nil {
		return c, errors.New("audit: Producer and Consumer are required")
	}
	if c.Since.IsZero() || c.Until.IsZero() || !c.Since.Before(c.Until) {
		return c, fmt.Errorf("audit: window [%v, %v): want Since before Until", c.Since, c.Until)
	}
	if c.Grace < 0 || c.ClockSkew < 0 || c.Examples < -1 || c.InboxPageSize < 0 || c.LookupBatch < 0 || c.LookupBatch > outboxaudit.MaxEventLookup || c.Prefetch < -1 {
		return c, fmt.Errorf("audit: Grace %v, ClockSkew %v, Examples %d, InboxPageSize %d, LookupBatch %d, Prefetch %d: want Grace, ClockSkew and InboxPageSize >= 0, Examples and Prefetch >= -1, LookupBatch in 0..%d",
			c.Grace, c.ClockSkew, c.Examples, c.InboxPageSize, c.LookupBatch, c.Prefetch, outboxaudit.MaxEventLookup)
	}
	c.Prefetch = cmp.Or(c.Prefetch, DefaultPrefetch)
	c.Grace = cmp.Or(c.Grace, DefaultGrace)
	c.ClockSkew = cmp.Or(c.ClockSkew, DefaultClockSkew)
	c.LookupBatch = cmp.Or(c.LookupBatch, DefaultLookupBatch)
	if c.Now.IsZero() {
		c.Now = time.Now()
	}
	switch c.Examples {
	case 0:
		c.Examples = DefaultExamples
	case -1:
		c.Examples = 0
	}
	return c, nil
}

// withDefaults0 is c with the window of a cycle, and its defaults.
func (c Config) withDefaults0(since, until, now time.Time) (Config, error) {
	c.Since, c.Until, c.Now = since, until, now
	return c.withDefaults()
}

// auditor is one run.
type auditor struct {
	cfg       Config
	r         *Report
	unmatched []string                  // inbox ids to look up in the outbox
	unapplied []outboxaudit.LoggedEvent // events to ask the accountant about
	keys      map[int64]string          // the byte-order keys of unapplied
	stale     time.Time                 // Now - Grace
	horizon   time.Time                 // min(Horizon, Since)
}

// Run audits cfg's window.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	start := time.Now()
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Report{Since: cfg.Since, Until: cfg.Until, Grace: cfg.Grace.String(), AuditedAt: cfg.Now}
	for _, b := range r.Buckets() {
		b.Examples = []string{}
	}
	a := &auditor{cfg: cfg, r: r, keys: map[int64]string{}, stale: cfg.Now.Add(-cfg.Grace), horizon: cfg.Since}
	if !cfg.Horizon.IsZero() && cfg.Horizon.Before(cfg.Since) {
		a.horizon = cfg.Horizon
	}
	if err := a.merge(ctx); err != nil {
		return nil, err
	}
	r.Seconds = time.Since(start).Seconds()
	return r, nil
}

func (a *auditor) merge(ctx context.Context) error {
	events, stop := a.producer(ctx)
	defer stop()
	next, stopInbox := pull(ctx, a.cfg, func(ctx context.Context) iter.Seq2[inbox.RecordedMessage, error] {
		return a.cfg.Consumer.Recorded(ctx, a.cfg.Since.Add(-a.cfg.ClockSkew), a.cfg.InboxPageSize)
	})
	defer stopInbox()

	e, ekey, eok, err := events()
	if err != nil {
		return err
	}
	pop := func() (inbox.RecordedMessage, bool, error) {
		r, err, ok := next()
		return r, ok, err
	}
	rec, rok, err := pop()
	if err != nil {
		return err
	}
	for eok || rok {
		switch {
		case !rok || eok && ekey < rec.MessageID:
			err = a.notRecorded(ctx, e, ekey)
			if err == nil {
				e, ekey, eok, err = events()
			}
		case !eok || rec.MessageID < ekey:
			a.r.InboxRecords++
			err = a.notCommitted(ctx, rec.MessageID)
			if err == nil {
				rec, rok, err = pop()
			}
		default:
			a.r.InboxRecords++
			if a.judged(e) {
				a.add(&a.r.Applied, ekey)
				if a.cfg.Observe != nil {
					a.cfg.Observe(e, true)
				}
			}
			if e, ekey, eok, err = events(); err == nil {
				rec, rok, err = pop()
			}
		}
		if err != nil {
			return err
		}
	}
	if err := a.lookUp(ctx); err != nil {
		return err
	}
	return a.account(ctx)
}

// pull opens a stream for the merge: read ahead in a goroutine of its own,
// or, with Prefetch -1, in the merge's.
func pull[T any](ctx context.Context, cfg Config, open func(context.Context) iter.Seq2[T, error]) (next func() (T, error, bool), stop func()) {
	if cfg.Prefetch < 0 {
		return iter.Pull2(open(ctx))
	}
	return prefetch(ctx, open, PrefetchBatch, cfg.Prefetch)
}

// digitRanges are the ranges of ids with 1, 2, ... 19 decimal digits.
func digitRanges() [][2]int64 {
	var out [][2]int64
	lo := int64(1)
	for d := 1; d <= 19; d++ {
		hi := int64(math.MaxInt64)
		if d < 19 {
			hi = lo*10 - 1
		}
		out = append(out, [2]int64{lo, hi})
		if d < 19 {
			lo *= 10
		}
	}
	return out
}

// producerStream is the outbox's events of one number of digits.
type producerStream struct {
	next func() (outboxaudit.LoggedEvent, error, bool)
	head outboxaudit.LoggedEvent
	key  string
}

// producer returns the outbox's events created at or after Since (later
// than Until too: their inbox records then need no look-up), in byte order
// of their decimal ids, with their keys; ok is false at the end.
func (a *auditor) producer(ctx context.Context) (next func() (e outboxaudit.LoggedEvent, key string, ok bool, err error), stop func()) {
	var (
		streams []*producerStream
		stops   []func()
		started bool
	)
	stop = func() {
		for _, s := range stops {
			s()
		}
	}
	advance := func(s *producerStream) (bool, error) {
		e, err, ok := s.next()
		if err != nil || !ok {
			return false, err
		}
		s.head, s.key = e, e.MessageID()
		return true, nil
	}
	next = func() (outboxaudit.LoggedEvent, string, bool, error) {
		if !started {
			started = true
			for _, rg := range digitRanges() {
				n, s := pull(ctx, a.cfg, func(ctx context.Context) iter.Seq2[outboxaudit.LoggedEvent, error] {
					// Narrow: the merge compares ids and creation times;
					// account reads the aggregates of the few events it
					// asks the consumer about.
					return a.cfg.Producer.Events(ctx, outboxaudit.EventWindow{Since: a.cfg.Since, MinID: rg[0], MaxID: rg[1], Narrow: true})
				})
				stops = append(stops, s)
				ps := &producerStream{next: n}
				ok, err := advance(ps)
				if err != nil {
					return outboxaudit.LoggedEvent{}, "", false, err
				}
				if ok {
					streams = append(streams, ps)
				} else {
					s()
				}
			}
		}
		if len(streams) == 0 {
			return outboxaudit.LoggedEvent{}, "", false, nil
		}
		first := 0
		for i, s := range streams[1:] {
			if s.key < streams[first].key {
				first = i + 1
			}
		}
		s := streams[first]
		e, key := s.head, s.key
		ok, err := advance(s)
		if err != nil {
			return outboxaudit.LoggedEvent{}, "", false, err
		}
		if !ok {
			streams = append(streams[:first], streams[first+1:]...)
		}
		return e, key, true, nil
	}
	return next, stop
}

// judged reports whether e is in the audited window; the producer side
// reads past Until.
func (a *auditor) judged(e outboxaudit.LoggedEvent) bool {
	if !e.CreatedAt.Before(a.cfg.Until) {
		return false
	}
	a.r.Checked++
	return true
}

func (a *auditor) add(b *Bucket, id string) {
	b.Count++
	if len(b.Examples) < a.cfg.Examples {
		b.Examples = append(b.Examples, id)
	}
}

// notRecorded judges an event the inbox has no record of.
func (a *auditor) notRecorded(ctx context.Context, e outboxaudit.LoggedEvent, key string) error {
	if !a.judged(e) {
		return nil
	}
	if a.cfg.Observe != nil {
		a.cfg.Observe(e, false)
	}
	switch e.State {
	case outbox.EventDeadLettered:
		a.add(&a.r.DeadLettered, key)
	case outbox.EventDiscarded:
		a.add(&a.r.Discarded, key)
	default:
		if a.cfg.Accountant == nil {
			a.unaccounted(e, key)
			return nil
		}
		a.unapplied = append(a.unapplied, e)
		a.keys[e.ID] = key
		if len(a.unapplied) >= a.cfg.LookupBatch {
			return a.account(ctx)
		}
	}
	return nil
}

// unaccounted puts an event neither the inbox nor the consumer accounts for
// in pending or missing.
func (a *auditor) unaccounted(e outboxaudit.LoggedEvent, key string) {
	last := e.CreatedAt
	if e.State == outbox.EventPublished {
		last = e.Since
	}
	if last.After(a.stale) {
		a.add(&a.r.Pending, key)
	} else {
		a.add(&a.r.Missing, key)
	}
}

// account asks the accountant about the events gathered so far.
func (a *auditor) account(ctx context.Context) error {
	if len(a.unapplied) == 0 {
		return nil
	}
	if err := a.aggregates(ctx); err != nil {
		return err
	}
	kept, err := a.cfg.Accountant.Account(ctx, a.unapplied)
	if err != nil {
		return fmt.Errorf("audit: ask the consumer about %d events: %w", len(a.unapplied), err)
	}
	for _, e := range a.unapplied {
		key := a.keys[e.ID]
		switch kept[e.ID] {
		case KeptEffect:
			a.add(&a.r.Unrecorded, key)
		case KeptHeld:
			a.add(&a.r.Held, key)
		default:
			a.unaccounted(e, key)
		}
	}
	a.unapplied = a.unapplied[:0]
	clear(a.keys)
	return nil
}

// aggregates fills in the aggregate of the unapplied events a narrow scan
// read (outboxaudit.EventWindow.Narrow), from the outbox: the accountant finds
// an event by its aggregate and version. An event the outbox no longer
// holds under that id and creation time keeps none.
func (a *auditor) aggregates(ctx context.Context) error {
	var ids []int64
	for _, e := range a.unapplied {
		if e.AggregateID == "" {
			ids = append(ids, e.ID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	found, err := a.cfg.Producer.Lookup(ctx, ids)
	if err != nil {
		return fmt.Errorf("audit: read the aggregates of %d events: %w", len(ids), err)
	}
	byID := make(map[int64][]outboxaudit.LoggedEvent, len(found))
	for _, e := range found {
		byID[e.ID] = append(byID[e.ID], e)
	}
	for i, e := range a.unapplied {
		for _, f := range byID[e.ID] {
			if f.CreatedAt.Equal(e.CreatedAt) {
				a.unapplied[i].AggregateType, a.unapplied[i].AggregateID, a.unapplied[i].AggregateVersion = f.AggregateType, f.AggregateID, f.AggregateVersion
			}
		}
	}
	return nil
}

// notCommitted handles an inbox record that matches no event of the
// producer side: an event created before Since, or a phantom.
func (a *auditor) notCommitted(ctx context.Context, msgID string) error {
	if _, _, err := outbox.ParseMessageID(msgID); err != nil {
		a.add(&a.r.Phantom, msgID) // no outbox event has such an id
		return nil
	}
	a.unmatched = append(a.unmatched, msgID)
	if len(a.unmatched) >= a.cfg.LookupBatch {
		return a.lookUp(ctx)
	}
	return nil
}

// lookUp looks the unmatched inbox ids up in the outbox: those it holds
// under the same creation time were created before Since, or committed
// after the scan went past them; those it does not hold were created
// before the horizon (purged since, not judged) or are phantoms.
func (a *auditor) lookUp(ctx context.Context) error {
	if len(a.unmatched) == 0 {
		return nil
	}
	ids := make([]int64, len(a.unmatched))
	for i, s := range a.unmatched {
		ids[i], _, _ = outbox.ParseMessageID(s)
	}
	found, err := a.cfg.Producer.Lookup(ctx, ids)
	if err != nil {
		return fmt.Errorf("audit: look up %d inbox ids in the outbox: %w", len(ids), err)
	}
	held := make(map[int64][]outboxaudit.LoggedEvent, len(found))
	for _, e := range found {
		held[e.ID] = append(held[e.ID], e)
	}
	for i, msgID := range a.unmatched {
		evs := held[ids[i]]
		_, created, _ := outbox.ParseMessageID(msgID)
		switch {
		case slices.ContainsFunc(evs, func(e outboxaudit.LoggedEvent) bool { return e.MessageID() == msgID }):
			if created.Before(a.cfg.Since) {
				a.add(&a.r.AppliedBeforeWindow, msgID)
			}
		case len(evs) == 0 && created.Before(a.horizon):
			// Older than what the outbox keeps: it applied an event the
			// outbox purged since (a dead letter replayed late).
			a.add(&a.r.AppliedBeforeWindow, msgID)
		default:
			// Not held though the outbox keeps events that old; or an
			// event of the same outbox id but another creation time is
			// not the one recorded: the database lost that one (a
			// failover) and handed its id out again.
			a.add(&a.r.Phantom, msgID)
		}
	}
	a.unmatched = a.unmatched[:0]
	return nil
}

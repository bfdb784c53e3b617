package outboxwal

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// aggKey names an aggregate.
type aggKey struct{ typ, id string }

// txn is a transaction decoded from the stream, or a position the server
// reported between transactions (sealed, with no events). The slot is
// acknowledged up to the end of the last transaction of the prefix whose
// events are all resolved.
type txn struct {
	end        uint64 // the transaction's end LSN, once sealed
	final      uint64 // its commit record's LSN, known from its first message
	sealed     bool
	open       int // events not resolved yet
	commitTime time.Time
	// xid is the transaction's id, and visible says a snapshot showed it
	// committed: the stream can deliver a transaction before other sessions
	// see it (see notVisible).
	xid     uint32
	visible atomic.Bool
}

// event is one outbox row decoded from the stream. It is resolved once
// nothing about it can be lost any more: the broker confirmed it and its row
// left the outbox table, or its row was handed over to polling (dead-lettered
// or parked behind a dead letter), or its row was found gone (published
// before a restart).
type event struct {
	env      outbox.Envelope
	key      aggKey
	tx       *txn
	check    bool // decoded from before this session: check its row first
	failures int
	resolved bool
	// suspect says an earlier session may have had the event in flight: it
	// committed at or below the dispatched position that session recorded.
	// The attempts of a suspect event, and every retry of any event, are
	// recorded in its row before they are made (recordAttemptsSQL).
	suspect bool
	// recorded says an attempt is recorded in the row and not made yet (the
	// publisher did not send it): the next attempt uses that record.
	recorded bool
	// alone says the event goes out alone until an attempt of it has an
	// outcome: an earlier session had it in flight when it stopped.
	alone bool
	// undecodable says why the row could not be decoded: it is
	// dead-lettered, not published, when its turn comes.
	undecodable string
	// taken says the event rides in flight behind its aggregate's head, in
	// the head's run (see take): it is not in the ready list, and it is
	// confirmed only if every earlier event of its run was.
	taken bool
}

// aggState is the queue of one aggregate's unconfirmed events, in order.
// busy says its head is in the ready list, in flight or backing off.
type aggState struct {
	q    []*event
	busy bool
}

// holdState is an aggregate whose events go to polling: it has a row handed
// over (a dead letter, or a row parked behind one). pending counts hand-overs
// not yet committed; gen is the writer's hand-over generation of the last
// one committed. The refresher releases it once a query that started after
// that generation finds no handed-over row of it.
type holdState struct {
	pending int
	gen     uint64
}

// handover is a row to hand over to polling: a dead letter, or a row parked
// behind an earlier handed-over row of its aggregate.
type handover struct {
	ev    *event
	dead  bool
	err   string
	added int // attempts to count in the row: a failed attempt not recorded yet
}

// state is what one session of the relay knows. Everything below mu is
// guarded by it.
type state struct {
	cfg Config
	// fence is the session's hold on the slot (outbox_wal_slots): every
	// batch and every write is conditional on it.
	fence fence
	// suspectBelow is the dispatched position the sessions before this one
	// recorded: events committed at or below it may have been in flight.
	suspectBelow uint64
	// solo is held shared by every batch in flight, and exclusively by a
	// suspect event published alone: one that an earlier session had in
	// flight when it stopped, and that may be what stops relays.
	solo sync.RWMutex

	mu     sync.Mutex
	work   chan struct{} // signalled when ready gains events
	closed bool

	txns  []*txn
	acked uint64
	aggs  map[aggKey]*aggState
	ready []*event
	held  map[aggKey]*holdState
	inMem int
	// inMemBytes is the size of the unresolved events' payloads and
	// headers (eventBytes).
	inMemBytes int64
	// backlog, while not nil, pins the aggregates of rows the stream does
	// not cover: their events are parked as if held (see backlog).
	backlog *backlog

	toSweep []*event
	toHand  []handover
	handGen uint64

	// firstAck is the first position the session acknowledged, and
	// progress says it resolved an event or acknowledged past firstAck.
	firstAck uint64
	progress bool

	timers map[*time.Timer]struct{}
}

func newState(cfg Config, f fence, suspectBelow uint64) *state {
	return &state{
		cfg:          cfg,
		fence:        f,
		suspectBelow: suspectBelow,
		work:         make(chan struct{}, 1),
		aggs:         map[aggKey]*aggState{},
		held:         map[aggKey]*holdState{},
		timers:       map[*time.Timer]struct{}{},
	}
}

func (s *state) signal() {
	select {
	case s.work <- struct{}{}:
	default:
	}
}

// close stops handing out work and stops the backoff timers.
func (s *state) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for t := range s.timers {
		t.Stop()
	}
	clear(s.timers)
}

func (s *state) hold(k aggKey) {
	if _, ok := s.held[k]; !ok {
		s.held[k] = &holdState{}
	}
}

// begin starts a transaction of the stream, whose commit record is at final.
func (s *state) begin(commitTime time.Time, xid uint32, final uint64) *txn {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := &txn{commitTime: commitTime, xid: xid, final: final}
	s.txns = append(s.txns, t)
	return t
}

// seal records the end of a transaction: every event of it was decoded.
func (s *state) seal(t *txn, end uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t.end, t.sealed = end, true
}

// position records a position the server reported between transactions:
// every transaction that committed before it was sent already.
func (s *state) position(lsn uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := len(s.txns); n > 0 {
		if last := s.txns[n-1]; !last.sealed || last.end >= lsn {
			return
		}
	} else if lsn <= s.acked {
		return
	}
	s.txns = append(s.txns, &txn{end: lsn, sealed: true})
}

// add queues an event decoded from t: for publishing, or for hand-over if its
// aggregate is held.
func (s *state) add(t *txn, env outbox.Envelope, check bool) {
	s.addEvent(&event{env: env, key: aggKey{env.AggregateType, env.AggregateID}, tx: t, check: check,
		suspect: t.final <= s.suspectBelow})
}

// addUndecodable queues a row decoded only in part (env has its id, and its
// aggregate when that could be read), to be dead-lettered in its turn.
func (s *state) addUndecodable(t *txn, env outbox.Envelope, reason string) {
	s.addEvent(&event{env: env, key: aggKey{env.AggregateType, env.AggregateID}, tx: t, undecodable: reason})
}

func (s *state) addEvent(ev *event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.backlog != nil && s.backlog.listed(ev.env.ID) {
		// A row of the backlog (a session that adopts the outbox streams
		// rows it also listed): polling publishes it, nothing to hold.
		return
	}
	t := ev.tx
	s.inMem++
	s.inMemBytes += eventBytes(ev)
	t.open++
	h, ok := s.held[ev.key]
	if !ok && s.backlog != nil && s.backlog.pinned(ev.key) {
		s.hold(ev.key)
		h, ok = s.held[ev.key], true
	}
	if ok {
		h.pending++
		ho := handover{ev: ev, err: parkedReason}
		if ev.undecodable != "" {
			ho.dead, ho.err = true, ev.undecodable
		}
		s.toHand = append(s.toHand, ho)
		return
	}
	a := s.aggs[ev.key]
	if a == nil {
		a = &aggState{}
		s.aggs[ev.key] = a
	}
	a.q = append(a.q, ev)
	if !a.busy {
		a.busy = true
		s.pushReady(ev)
	}
}

func (s *state) pushReady(ev *event) {
	s.ready = append(s.ready, ev)
	s.signal()
}

// inMemory is how many events are held and not resolved.
func (s *state) inMemory() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inMem
}

// full says whether the unresolved events reach MaxInMemory or
// MaxInMemoryBytes: the stream then waits.
func (s *state) full() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inMem >= s.cfg.MaxInMemory || (s.cfg.MaxInMemoryBytes > 0 && s.inMem > 0 && s.inMemBytes >= s.cfg.MaxInMemoryBytes)
}

// eventBytes is what an event holds in memory, as MaxInMemoryBytes counts
// it: its payload and its headers' names and values.
func eventBytes(ev *event) int64 {
	n := int64(len(ev.env.Payload))
	for k, v := range ev.env.Headers {
		n += int64(len(k) + len(v))
	}
	return n
}

// take returns up to n events, or none: ready heads, each followed by a run
// of its aggregate's next events, in version order.
//
// Runs, as the polling relay's claim makes them: the heads leave room in the
// batch (n minus their number), shared among them; behind a head that never
// failed, the aggregate's next decoded events that never failed either (not
// suspect, alone or undecodable) ride along, until one that may not
// or the head's share. They are sent in version order on one channel, and
// an event of a run counts as confirmed only if every earlier one of its
// run was (see send): one busy aggregate goes out a batch at a time, not an
// event per round trip.
func (s *state) take(n int) []*event {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || len(s.ready) == 0 {
		return nil
	}
	heads := min(n, len(s.ready))
	share := 0
	if room := n - heads; room > 0 {
		share = (room + heads - 1) / heads
	}
	out := make([]*event, 0, n)
	for _, h := range s.ready[:heads] {
		out = append(out, h)
		a := s.aggs[h.key]
		if share == 0 || !runnable(h) || a == nil || len(a.q) == 0 || a.q[0] != h {
			continue
		}
		for k, f := range a.q[1:] {
			if k >= share || len(out) >= n || !runnable(f) {
				break
			}
			f.taken = true
			out = append(out, f)
		}
	}
	s.ready = s.ready[heads:]
	if len(s.ready) > 0 {
		s.signal() // let another worker take the rest
	}
	return out
}

// runnable says whether ev may head a run or ride in one: it never failed,
// and needs neither a recorded attempt nor to go alone. An event decoded
// from before the session (check) may: publish looks its row up first, and
// takes one found gone or handed over out of the run.
func runnable(ev *event) bool {
	return ev.failures == 0 && !ev.suspect && !ev.alone && !ev.recorded && ev.undecodable == ""
}

// drop takes evs out of their runs: the later events of an aggregate's run
// go back to waiting behind it, untaken, and an event that heads its
// aggregate is readied again after d. It returns the events that leave the
// batch: evs and the rest of their runs.
func (s *state) drop(evs []*event, d time.Duration) map[*event]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[*event]bool{}
	for _, ev := range evs {
		if out[ev] {
			continue
		}
		out[ev] = true
		a := s.aggs[ev.key]
		if a == nil {
			continue
		}
		i := slices.Index(a.q, ev)
		if i < 0 {
			continue
		}
		for _, later := range a.q[i:] {
			if later.taken {
				later.taken = false
				out[later] = true
			}
		}
		if i == 0 {
			s.retryLocked(ev, d)
		}
	}
	return out
}

// giveBack returns events taken but not published (the session is ending).
func (s *state) giveBack(evs []*event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ready = append(evs, s.ready...)
}

// advance removes the head ev of its aggregate and readies the next one.
func (s *state) advance(ev *event) {
	a := s.aggs[ev.key]
	if a == nil || len(a.q) == 0 || a.q[0] != ev {
		return
	}
	a.q[0] = nil
	a.q = a.q[1:]
	a.busy = false
	if len(a.q) == 0 {
		delete(s.aggs, ev.key)
		return
	}
	a.busy = true
	if !a.q[0].taken { // in flight in ev's run: its outcome readies the next
		s.pushReady(a.q[0])
	}
}

func (s *state) resolve(ev *event) {
	if ev.resolved {
		return
	}
	ev.resolved = true
	s.progress = true
	ev.tx.open--
	s.inMem--
	s.inMemBytes -= eventBytes(ev)
}

// confirmed records a broker confirm: the aggregate's next event may go, and
// the row is swept.
func (s *state) confirmed(evs []*event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ev := range evs {
		s.toSweep = append(s.toSweep, ev)
		s.advance(ev)
	}
}

// gone records events whose rows are no longer in the outbox (published and
// swept before this session): nothing is left to do for them.
func (s *state) gone(evs []*event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ev := range evs {
		s.advance(ev)
		s.resolve(ev)
	}
}

// handAll hands ev's aggregate over to polling: ev (dead-lettered if dead,
// with reason as its error, and added more attempts counted) and every later
// event of the aggregate.
func (s *state) handAll(ev *event, dead bool, reason string, added int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hold(ev.key)
	h := s.held[ev.key]
	a := s.aggs[ev.key]
	delete(s.aggs, ev.key)
	first := handover{ev: ev, dead: dead, err: cmp.Or(reason, handedReason), added: added}
	s.toHand = append(s.toHand, first)
	h.pending++
	if a == nil {
		return
	}
	for _, later := range a.q {
		if later == ev {
			continue
		}
		s.toHand = append(s.toHand, handover{ev: later, err: parkedReason})
		h.pending++
	}
}

// retryLater readies ev again after d, or at once for d <= 0.
func (s *state) retryLater(ev *event, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.retryLocked(ev, d)
}

func (s *state) retryLocked(ev *event, d time.Duration) {
	if s.closed {
		return
	}
	if d <= 0 {
		s.pushReady(ev)
		return
	}
	var t *time.Timer
	t = time.AfterFunc(d, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		delete(s.timers, t)
		if !s.closed {
			s.pushReady(ev)
		}
	})
	s.timers[t] = struct{}{}
}

// takeWrites returns the rows to sweep (up to max) and to hand over.
func (s *state) takeWrites(max int) ([]*event, []handover) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := min(max, len(s.toSweep))
	sweep := s.toSweep[:n:n]
	s.toSweep = s.toSweep[n:]
	hand := s.toHand
	s.toHand = nil
	return sweep, hand
}

// pendingWrites says whether the writer has work.
func (s *state) pendingWrites() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.toSweep) + len(s.toHand)
}

// written records what the writer committed: swept rows and hand-overs are
// resolved; skipped rows and postponed hand-overs are queued again.
func (s *state) written(res writeResult) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ev := range res.swept {
		s.resolve(ev)
	}
	s.toSweep = append(res.skipped, s.toSweep...)
	if len(res.handed) > 0 {
		s.handGen++
	}
	for _, h := range res.handed {
		if hs, ok := s.held[h.ev.key]; ok {
			hs.pending--
			hs.gen = s.handGen
		}
		s.resolve(h.ev)
	}
	s.toHand = append(res.postponed, s.toHand...)
}

// writeFailed queues everything again after a failed write.
func (s *state) writeFailed(sweep []*event, hand []handover) {
	s.written(writeResult{skipped: sweep, postponed: hand})
}

// heldSnapshot returns whether any aggregate is held, and the hand-over
// generation, read before a refresh query.
func (s *state) heldSnapshot() (bool, uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.held) > 0, s.handGen
}

// unpin drops the backlog's pins.
func (s *state) unpin() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.backlog = nil
}

// setHeld adds the aggregates found with handed-over rows, and releases those
// that have none any more: no hand-over of theirs is pending, and the last one
// committed before the query (generation gen) started.
func (s *state) setHeld(present map[aggKey]bool, gen uint64, release bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := range present {
		s.hold(k)
	}
	if !release {
		return
	}
	for k, h := range s.held {
		if !present[k] && h.pending == 0 && h.gen <= gen {
			delete(s.held, k)
		}
	}
}

// ack returns the position below which every event is resolved.
func (s *state) ack() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := 0
	for ; i < len(s.txns); i++ {
		t := s.txns[i]
		if !t.sealed || t.open > 0 && !mutantWALAckPast { // mutantWALAckPast: a planted bug
			break
		}
		s.acked = max(s.acked, t.end)
	}
	if s.firstAck == 0 {
		s.firstAck = s.acked
	} else if s.acked > s.firstAck {
		s.progress = true
	}
	clear(s.txns[:i])
	s.txns = s.txns[i:]
	return s.acked
}

// progressed says the session resolved an event or acknowledged a new
// position.
func (s *state) progressed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.progress
}

// oldest is the commit time of the oldest transaction with an unresolved
// event, zero when there is none.
func (s *state) oldest() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range s.txns {
		if t.open > 0 {
			return t.commitTime
		}
		if !t.sealed {
			break
		}
	}
	return time.Time{}
}

// waitWork waits for a signal that work may be ready, ctx's end, or d.
func (s *state) waitWork(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-s.work:
	case <-t.C:
	}
}

const (
	parkedReason = "waiting behind an earlier event of its aggregate that failed: handed over to polling by the WAL relay"
	handedReason = "handed over to polling by the WAL relay"
)

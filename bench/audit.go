package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"iter"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
	"github.com/outbox-inbox/reference/services/shipping/accounting"
)

// runAudit measures the loss audit (internal/audit, as cmd/audit runs it)
// over auditEvents events: published rows in an outbox (seedDirect's
// publishedOrders, spread over 7.7 days) and as many done records in
// shipping's inbox, with their tallies (inboxSeed), on a FerretDB in a
// process of its own, so that the heap measured during the audit is the audit's.
// The baseline is the inbox side read alone with the same query: on
// FerretDB, which pushes neither the range nor the sort down to SQLite, it
// bounds the audit. The details give the same audit without read-ahead
// (Prefetch -1), run just after, on the same stores, and against the same
// records held in memory.
func (b *bench) runAudit(ctx context.Context) ([]Figure, error) {
	n := b.cfg.auditEvents
	_, pool, err := b.env.openDatabase(ctx, "audit", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	start := time.Now()
	if err := (seedDirect{pool}).publishedOrders(ctx, n); err != nil {
		return nil, err
	}
	b.log.Info("audit: events written", "events", n, "seconds", int(time.Since(start).Seconds()))

	uri, _, err := b.ferretProcess(ctx)
	if err != nil {
		return nil, err
	}
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetMaxPoolSize(32))
	if err != nil {
		return nil, err
	}
	defer func() { _ = client.Disconnect(context.WithoutCancel(ctx)) }()
	db := client.Database("bench_audit")

	// The message ids the relay publishes the events under.
	events, err := outboxaudit.NewEventLog(pool, 0)
	if err != nil {
		return nil, err
	}
	msgIDs := make([]string, 0, n)
	for e, err := range events.Events(ctx, outboxaudit.EventWindow{}) {
		if err != nil {
			return nil, fmt.Errorf("read the outbox: %w", err)
		}
		msgIDs = append(msgIDs, e.MessageID())
	}

	// Shipping's inbox: consumer "shipping", its records and tallies
	// written directly (inboxSeed).
	inboxCfg := shippingInbox(inbox.StandaloneConfig{})
	in, err := inbox.New(db, inboxCfg)
	if err != nil {
		return nil, err
	}
	start = time.Now()
	if err := inboxSeedFor(inboxCfg).seed(ctx, in, msgIDs); err != nil {
		return nil, err
	}
	seedRate := rate(n, time.Since(start))
	b.log.Info("audit: inbox records written", "records", n, "seconds", int(time.Since(start).Seconds()), "per_s", int(seedRate))

	// One page for the whole inbox: FerretDB reads and sorts the whole
	// collection for each page, so pages of 10,000 would read it n/10,000
	// times.
	inboxPage := n + 1
	start = time.Now()
	read := 0
	for _, err := range in.Recorded(ctx, time.Time{}, inboxPage) {
		if err != nil {
			return nil, fmt.Errorf("read the inbox: %w", err)
		}
		read++
	}
	inboxRead := rate(read, time.Since(start))
	// The outbox side read alone, as the audit reads it (narrow).
	start = time.Now()
	read = 0
	for _, err := range events.Events(ctx, outboxaudit.EventWindow{Narrow: true}) {
		if err != nil {
			return nil, fmt.Errorf("read the outbox: %w", err)
		}
		read++
	}
	outboxRead := rate(read, time.Since(start))
	b.log.Info("audit: each side read alone", "inbox_per_s", int(inboxRead), "outbox_per_s", int(outboxRead))

	// The audit twice: as cmd/audit runs it, each stream read ahead in a
	// goroutine of its own, then with each stream read in the merge's
	// goroutine, one side after the other (Prefetch -1).
	runOnce := func(prefetch int) (*audit.Report, error) {
		now := time.Now()
		r, err := audit.Run(ctx, audit.Config{
			Producer: events, Consumer: in, Prefetch: prefetch,
			Since: now.Add(-8 * 24 * time.Hour), Until: now, Now: now, InboxPageSize: inboxPage,
		})
		if err != nil {
			return nil, fmt.Errorf("audit: %w", err)
		}
		if r.Checked != int64(n) || r.Applied.Count != int64(n) || !r.Whole() {
			return nil, fmt.Errorf("audit of %d events: checked %d, applied %d, missing %d, phantom %d", n, r.Checked, r.Applied.Count, r.Missing.Count, r.Phantom.Count)
		}
		return r, nil
	}
	// The same audit with the inbox side made in memory (the same records,
	// in the same order): what the audit does when the inbox's server keeps
	// up, as MongoDB's range scans of the _id index would.
	memory := newMemoryInbox(msgIDs)
	inMemory := func(prefetch int) (float64, error) {
		now := time.Now()
		r, err := audit.Run(ctx, audit.Config{
			Producer: events, Consumer: memory, Prefetch: prefetch,
			Since: now.Add(-8 * 24 * time.Hour), Until: now, Now: now,
		})
		if err != nil {
			return 0, fmt.Errorf("audit against the inbox in memory: %w", err)
		}
		if r.Checked != int64(n) || r.Applied.Count != int64(n) || !r.Whole() {
			return 0, fmt.Errorf("audit of %d events against the inbox in memory: checked %d, applied %d", n, r.Checked, r.Applied.Count)
		}
		return float64(n) / r.Seconds, nil
	}
	memRate, err := inMemory(0)
	if err != nil {
		return nil, err
	}
	memSeqRate, err := inMemory(-1)
	if err != nil {
		return nil, err
	}
	// The merge alone: both sides held in memory.
	compareRate, err := compareInMemory(ctx, events, memory, n)
	if err != nil {
		return nil, err
	}
	memory = memoryInbox{}
	b.log.Info("audit against the inbox in memory", "events", n, "per_s", int(memRate), "without_read_ahead_per_s", int(memSeqRate), "compare_in_memory_per_s", int(compareRate))
	stopSampling := sampleHeap()
	r, err := runOnce(0)
	base, peakHeap := stopSampling()
	if err != nil {
		return nil, err
	}
	auditRate := float64(n) / r.Seconds
	b.log.Info("audit", "events", n, "seconds", r.Seconds, "per_s", int(auditRate), "heap_peak_mib", peakHeap>>20)
	seq, err := runOnce(-1)
	if err != nil {
		return nil, err
	}
	seqRate := float64(n) / seq.Seconds
	b.log.Info("audit without read-ahead", "events", n, "seconds", seq.Seconds, "per_s", int(seqRate))
	details := map[string]any{
		"events": n, "audit_seconds": r.Seconds, "inbox_seed_per_s": int(seedRate),
		"inbox_read_alone_per_s": int(inboxRead), "outbox_read_alone_per_s": int(outboxRead),
		"audit_without_read_ahead_per_s": int(seqRate), "audit_without_read_ahead_seconds": seq.Seconds,
		"audit_inbox_in_memory_per_s": int(memRate), "audit_inbox_in_memory_without_read_ahead_per_s": int(memSeqRate),
		"compare_in_memory_per_s": int(compareRate),
		"heap_in_use_before_mib":  base >> 20, "heap_in_use_peak_mib": peakHeap >> 20,
		"event_log_page": outboxaudit.DefaultEventLogPage, "inbox_page": inboxPage, "prefetch_batches": audit.DefaultPrefetch,
	}
	incremental, err := b.auditIncremental(ctx, pool, db, events, n, r.Seconds)
	if err != nil {
		return nil, err
	}
	split := newFigure("audit_without_inbox_read", "events/s", memRate, outboxRead, Goal{ValueAtLeast, 100_000},
		fmt.Sprintf("events audited per second by the same audit of %d events against the same inbox records held in memory: PostgreSQL's side and the merge, everything but the MongoDB read (details: the merge alone, both sides in memory)", n),
		"the outbox side read alone, as the audit reads it (EventLog.Events, narrow)",
		map[string]any{"events": n, "compare_in_memory_per_s": int(compareRate), "outbox_read_alone_per_s": int(outboxRead), "inbox_read_alone_per_s": int(inboxRead)})
	return []Figure{incremental, split, newFigure("audit", "events/s", auditRate, inboxRead, Goal{ValueAtLeast, 100_000},
		fmt.Sprintf("events audited per second by internal/audit (cmd/audit): %d published events in PostgreSQL against as many done records in shipping's inbox on FerretDB (a process of its own), merged by id; the audit's heap peaked at %d MiB",
			n, peakHeap>>20),
		"the same inbox records read alone (Inbox.Recorded, the audit's query: one page, which FerretDB reads and sorts whole)", details)}, nil
}

// auditNewEvents is how many new events the incremental cycle audits.
const auditNewEvents = 10_000

// auditIncremental measures one cycle of the incremental audit (cmd/audit
// -every) after auditNewEvents new events over the n of the history: its
// first cycle, a full audit, builds its state; then the events are
// committed (outbox.Enqueue, a thousand a transaction) and recorded in the
// inbox as shipping records them (Process, with its tallies), and the next
// cycle is timed. The baseline is the full audit's time (fullSeconds); the details
// give what looking the new events up one by one takes (what a cycle does
// without tallies).
func (b *bench) auditIncremental(ctx context.Context, pool *pgxpool.Pool, db *mongo.Database, events *outboxaudit.EventLog, n int, fullSeconds float64) (Figure, error) {
	reader, err := inbox.New(db, shippingInbox(inbox.StandaloneConfig{}))
	if err != nil {
		return Figure{}, err
	}
	inc, err := audit.NewIncremental(audit.IncrementalConfig{
		Config: audit.Config{Producer: events, Consumer: reader, InboxPageSize: n + 1}, Done: reader, Tallies: reader,
	})
	if err != nil {
		return Figure{}, err
	}
	since := time.Now().Add(-8 * 24 * time.Hour)
	now := time.Now()
	first, err := inc.Cycle(ctx, since, now.Add(time.Minute), now)
	if err != nil {
		return Figure{}, fmt.Errorf("incremental audit, first cycle: %w", err)
	}
	if first.Checked != int64(n) || first.Applied.Count != int64(n) {
		return Figure{}, fmt.Errorf("incremental audit, first cycle: checked %d, applied %d, want %d", first.Checked, first.Applied.Count, n)
	}
	added := auditNewEvents
	var msgIDs []string
	for i := 0; i < added; i += 1000 {
		msgs := make([]outbox.Message, min(1000, added-i))
		for j := range msgs {
			msgs[j] = outbox.Message{AggregateType: "order", AggregateID: fmt.Sprintf("new-%d", i+j), EventType: "order.created", Payload: []byte(`{}`)}
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			enq, err := new(outbox.Writer).Enqueue(ctx, tx, msgs...)
			for _, e := range enq {
				msgIDs = append(msgIDs, outbox.MessageID(e.ID, e.CreatedAt))
			}
			return err
		})
		if err != nil {
			return Figure{}, fmt.Errorf("commit the new events: %w", err)
		}
	}
	writer, err := inbox.New(db, shippingInbox(inbox.StandaloneConfig{FlushInterval: 10 * time.Millisecond}))
	if err != nil {
		return Figure{}, err
	}
	if err := recordAll(ctx, writer, msgIDs, 16); err != nil {
		return Figure{}, fmt.Errorf("record the new events: %w", err)
	}
	now = time.Now()
	r, err := inc.Cycle(ctx, since, now.Add(time.Minute), now)
	if err != nil {
		return Figure{}, fmt.Errorf("incremental audit, second cycle: %w", err)
	}
	if r.Checked != int64(n+added) || r.Applied.Count != int64(n+added) || !r.Whole() {
		return Figure{}, fmt.Errorf("incremental audit, second cycle: checked %d, applied %d, want %d", r.Checked, r.Applied.Count, n+added)
	}
	// What the cycle would spend without tallies: the new events looked up
	// by _id, DefaultLookups at a time, by an inbox without a done cache.
	byID, err := inbox.New(db, inbox.Config{Consumer: "shipping", DoneCacheSize: -1})
	if err != nil {
		return Figure{}, err
	}
	start := time.Now()
	if err := lookUpAll(ctx, byID, msgIDs, audit.DefaultLookups); err != nil {
		return Figure{}, err
	}
	byIDSeconds := time.Since(start).Seconds()
	b.log.Info("audit: incremental cycle", "history", n, "new_events", added, "seconds", r.Seconds, "first_cycle_seconds", first.Seconds, "lookups_by_id_seconds", byIDSeconds)
	return newFigure("audit_incremental", "s", r.Seconds, fullSeconds, Goal{ValueAtMost, 2},
		fmt.Sprintf("seconds of one incremental audit cycle (cmd/audit -every) after %d new events committed and recorded over a history of %d: the outbox read above its watermark (PostgreSQL), the tallies of the new events' buckets read from shipping's inbox on FerretDB", added, n),
		"the full audit of the same history (seconds)",
		map[string]any{"history": n, "new_events": added, "first_cycle_seconds": first.Seconds, "lookups_by_id_seconds": byIDSeconds, "lookups": audit.DefaultLookups}), nil
}

// shippingInbox is shipping's inbox configuration as the audit meets it:
// consumer "shipping", creation times from the message ids, tallies of a
// minute; records kept 8 days, so that the history's 7.7 days are within
// its dedup horizon.
func shippingInbox(sa inbox.StandaloneConfig) inbox.Config {
	return inbox.Config{Consumer: "shipping", MessageTime: accounting.MessageTime, TallyBucket: audit.DefaultBucket,
		Retention: 8 * 24 * time.Hour, Standalone: sa}
}

// lookUpAll asks in whether each of msgIDs is done, from clients
// goroutines, and fails unless all are.
func lookUpAll(ctx context.Context, in *inbox.Inbox, msgIDs []string, clients int) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, clients)
	for c := range clients {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(len(msgIDs)) {
					return
				}
				ok, err := in.IsDone(ctx, msgIDs[i])
				if err == nil && !ok {
					err = fmt.Errorf("message %s not done", msgIDs[i])
				}
				if err != nil {
					errs[c] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// compareInMemory audits n events with both sides held in memory (the
// outbox's events read once, narrow, and the inbox's records): the merge
// alone.
func compareInMemory(ctx context.Context, events *outboxaudit.EventLog, memory memoryInbox, n int) (float64, error) {
	held := memoryOutbox{events: make([]outboxaudit.LoggedEvent, 0, n)}
	for e, err := range events.Events(ctx, outboxaudit.EventWindow{Narrow: true}) {
		if err != nil {
			return 0, fmt.Errorf("read the outbox: %w", err)
		}
		held.events = append(held.events, e)
	}
	now := time.Now()
	r, err := audit.Run(ctx, audit.Config{
		Producer: held, Consumer: memory, Since: now.Add(-8 * 24 * time.Hour), Until: now, Now: now,
	})
	if err != nil {
		return 0, fmt.Errorf("audit in memory: %w", err)
	}
	if r.Checked != int64(n) || r.Applied.Count != int64(n) || !r.Whole() {
		return 0, fmt.Errorf("audit of %d events in memory: checked %d, applied %d", n, r.Checked, r.Applied.Count)
	}
	return float64(n) / r.Seconds, nil
}

// memoryOutbox is an outbox's events held in memory, in id order.
type memoryOutbox struct{ events []outboxaudit.LoggedEvent }

func (m memoryOutbox) Events(ctx context.Context, w outboxaudit.EventWindow) iter.Seq2[outboxaudit.LoggedEvent, error] {
	return func(yield func(outboxaudit.LoggedEvent, error) bool) {
		lo, _ := slices.BinarySearchFunc(m.events, w.MinID, func(e outboxaudit.LoggedEvent, id int64) int { return cmp.Compare(e.ID, id) })
		for _, e := range m.events[lo:] {
			if w.MaxID != 0 && e.ID > w.MaxID {
				return
			}
			if !yield(e, nil) {
				return
			}
		}
	}
}

func (m memoryOutbox) Lookup(ctx context.Context, ids []int64) ([]outboxaudit.LoggedEvent, error) {
	return nil, errors.New("memory outbox: no look-ups")
}

// memoryInbox is an inbox that recorded the messages ids, held in memory
// in byte order, as Inbox.Recorded yields them.
type memoryInbox struct{ ids []string }

func newMemoryInbox(msgIDs []string) memoryInbox {
	ids := slices.Clone(msgIDs)
	slices.Sort(ids)
	return memoryInbox{ids: ids}
}

func (m memoryInbox) Recorded(ctx context.Context, since time.Time, pageSize int) iter.Seq2[inbox.RecordedMessage, error] {
	return func(yield func(inbox.RecordedMessage, error) bool) {
		at := time.Now()
		for _, id := range m.ids {
			if !yield(inbox.RecordedMessage{MessageID: id, ProcessedAt: at}, nil) {
				return
			}
		}
	}
}

// recordAll records msgIDs as done in in, as the shipping service does for
// each event it applies, from clients goroutines.
func recordAll(ctx context.Context, in *inbox.Inbox, msgIDs []string, clients int) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, clients)
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(len(msgIDs)) || ctx.Err() != nil {
					return
				}
				if _, err := in.Process(ctx, msgIDs[i], func(context.Context) error { return nil }); err != nil {
					errs[c] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	return errors.Join(append(errs, in.Close(closeCtx), ctx.Err())...)
}

// sampleHeap samples the heap in use every 20ms until the function it
// returns is called, which returns the heap in use when sampling started
// and the peak.
func sampleHeap() func() (base, peak uint64) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	var peak atomic.Uint64
	peak.Store(base)
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		var ms runtime.MemStats
		for {
			select {
			case <-done:
				return
			case <-t.C:
				runtime.ReadMemStats(&ms)
				if ms.HeapInuse > peak.Load() {
					peak.Store(ms.HeapInuse)
				}
			}
		}
	}()
	return func() (uint64, uint64) {
		close(done)
		<-exited
		return base, peak.Load()
	}
}

// ferretProcess returns the run's FerretDB process (cmd/mongolocal), started
// on first use: its URI and its process id (for the CPU instrument's mongodb
// group). The figures that use it work in databases of their own, one
// after the other.
func (b *bench) ferretProcess(ctx context.Context) (string, int, error) {
	b.env.ferretProcOnce.Do(func() {
		b.env.ferretProcURI, b.env.ferretProcPID, b.env.ferretProcErr = b.startFerretProcess(ctx)
	})
	return b.env.ferretProcURI, b.env.ferretProcPID, b.env.ferretProcErr
}

// startFerretProcess builds cmd/mongolocal and runs it, on a free port and
// a data directory of its own, until the run ends.
func (b *bench) startFerretProcess(ctx context.Context) (string, int, error) {
	dir, err := os.MkdirTemp("", "bench-ferretdb-")
	if err != nil {
		return "", 0, err
	}
	b.env.onClose("FerretDB process data "+dir, func(context.Context) error { return os.RemoveAll(dir) })
	bin := filepath.Join(dir, "mongolocal")
	build := exec.CommandContext(ctx, goCommand(), "build", "-o", bin, "./cmd/mongolocal")
	build.Dir = b.env.root
	if out, err := build.CombinedOutput(); err != nil {
		return "", 0, fmt.Errorf("go build ./cmd/mongolocal: %w: %s", err, out)
	}
	addr, err := freeAddr()
	if err != nil {
		return "", 0, err
	}
	logFile, err := os.Create(filepath.Join(dir, "mongolocal.log"))
	if err != nil {
		return "", 0, err
	}
	cmd := exec.Command(bin, "-addr", addr, "-data-dir", filepath.Join(dir, "data"))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return "", 0, fmt.Errorf("start mongolocal: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	b.env.onClose("FerretDB process "+addr, func(context.Context) error {
		defer logFile.Close()
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
			return nil
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
			return errors.New("mongolocal did not stop within 30s of SIGTERM; killed")
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			_ = c.Close()
			return "mongodb://" + addr + "/", cmd.Process.Pid, nil
		}
		select {
		case err := <-exited:
			return "", 0, fmt.Errorf("mongolocal exited before listening (%v); see %s", err, logFile.Name())
		case <-ctx.Done():
			return "", 0, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return "", 0, fmt.Errorf("mongolocal not listening after 60s; see %s", logFile.Name())
		}
	}
}

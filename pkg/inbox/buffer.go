package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// Buffered done records (Config.Standalone.FlushInterval, without a
// Lease). Process buffers the record of a message whose handler succeeded
// and returns; a flusher goroutine, started with the first buffered record
// and stopped by Close, writes the buffer with unordered InsertMany calls of
// at most FlushBatch records, every FlushInterval or as soon as FlushBatch
// records wait. A record stays in the buffer, where IsDone and Process see
// it, until its write was acknowledged; a failed write is kept and retried.

const (
	// flushTimeout bounds one background flush.
	flushTimeout = 30 * time.Second
	// maxFlushBackoff caps the pause between flushes after failures.
	maxFlushBackoff = time.Second
)

// pendingRecord is a buffered done record.
type pendingRecord struct {
	at       time.Time // when the handler's effect was acknowledged: processed_at
	attempts int       // failed writes so far
}

// recordBuffer holds the done records not yet written.
type recordBuffer struct {
	interval time.Duration
	batch    int
	max      int // most records held

	mu      sync.Mutex
	pending map[string]*pendingRecord // by message id
	started bool                      // the flusher was started
	closed  bool                      // Close was called: no more buffering
	full    bool                      // the buffer was found full (logged once until it has room)

	wake     chan struct{} // a record was buffered (capacity 1)
	kick     chan struct{} // batch records wait (capacity 1)
	stop     chan struct{} // closed by Close
	done     chan struct{} // closed when the flusher returned
	stopOnce sync.Once

	flushMu sync.Mutex // one flush at a time
}

func newRecordBuffer(interval time.Duration, batch, maxRecords int) *recordBuffer {
	return &recordBuffer{
		interval: interval,
		batch:    batch,
		max:      maxRecords,
		pending:  map[string]*pendingRecord{},
		wake:     make(chan struct{}, 1),
		kick:     make(chan struct{}, 1),
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
	}
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// has reports whether msgID's record is buffered (not yet acknowledged).
func (b *recordBuffer) has(msgID string) bool {
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	_, ok := b.pending[msgID]
	return ok
}

func (b *recordBuffer) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.pending)
}

// bufferDone buffers msgID's done record, starting the flusher if needed. It
// returns false, buffering nothing, once Close was called or while the
// buffer is full: the caller then writes the record itself.
func (in *Inbox) bufferDone(msgID string) bool {
	b := in.buf
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return false
	}
	if _, ok := b.pending[msgID]; !ok { // a concurrent duplicate's is as good
		if len(b.pending) >= b.max {
			first := !b.full
			b.full = true
			b.mu.Unlock()
			if first {
				in.log.Warn("inbox: buffer of done records full, writing records synchronously until flushes catch up",
					"records", b.max, "consumer", in.consumer)
			}
			signal(b.kick)
			return false
		}
		b.full = false
		b.pending[msgID] = &pendingRecord{at: time.Now()}
	}
	n := len(b.pending)
	start := !b.started
	b.started = true
	b.mu.Unlock()

	if start {
		go in.runFlusher()
	}
	signal(b.wake)
	if n >= b.batch {
		signal(b.kick)
	}
	return true
}

// runFlusher writes the buffer every interval (sooner when a batch is full)
// until Close stops it. After a failed flush it waits longer, doubling up to
// maxFlushBackoff, and does not flush early for a full batch.
func (in *Inbox) runFlusher() {
	b := in.buf
	defer close(b.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	failures := 0
	for {
		if b.len() == 0 {
			select {
			case <-b.stop:
				return
			case <-b.wake:
			}
		}
		wait, kick := b.interval, b.kick
		if failures > 0 {
			wait = min(b.interval<<min(failures, 16), max(b.interval, maxFlushBackoff))
			kick = nil
		}
		timer.Reset(wait)
		select {
		case <-b.stop:
			return
		case <-timer.C:
		case <-kick:
			timer.Stop()
		}
		ctx, cancel := context.WithTimeout(context.Background(), flushTimeout)
		_, err := in.flush(ctx)
		cancel()
		if err != nil {
			failures++
		} else {
			failures = 0
		}
	}
}

// flush writes the buffered records, FlushBatch at a time, and drops from
// the buffer those whose write was acknowledged (or found done). It returns
// how many records remain buffered and the first error. A batch that failed
// as a whole ends the flush: the rest waits for the next one.
func (in *Inbox) flush(ctx context.Context) (remaining int, err error) {
	b := in.buf
	b.flushMu.Lock()
	defer b.flushMu.Unlock()

	b.mu.Lock()
	ids := make([]string, 0, len(b.pending))
	recs := make([]pendingRecord, 0, len(b.pending))
	for id, r := range b.pending {
		ids = append(ids, id)
		recs = append(recs, *r)
	}
	b.mu.Unlock()

	var firstErr error
	for start := 0; start < len(ids); start += b.batch {
		end := min(start+b.batch, len(ids))
		written, whole, err := in.writeRecords(ctx, ids[start:end], recs[start:end])
		b.mu.Lock()
		for i, id := range ids[start:end] {
			if written[i] {
				delete(b.pending, id)
			} else if r := b.pending[id]; r != nil {
				r.attempts++
			}
		}
		b.mu.Unlock()
		if err != nil {
			firstErr = cmp.Or(firstErr, err)
			if whole {
				break
			}
		}
	}
	return b.len(), firstErr
}

// writeRecords inserts the done records of ids with one unordered
// InsertMany. written[i] reports that ids[i]'s record is durable: inserted,
// or, after a duplicate key, found done or turned into done (a concurrent
// duplicate recorded it first, or a Lease-mode claim is there), as in
// recordDone. whole reports an error that says nothing about single records
// (unreachable server, write concern error): all of them are retried.
func (in *Inbox) writeRecords(ctx context.Context, ids []string, recs []pendingRecord) (written []bool, whole bool, err error) {
	written = make([]bool, len(ids))
	docs := make([]any, len(ids))
	for i, id := range ids {
		docs[i] = in.newRecord(id, in.doneFields(recs[i].at))
	}
	_, err = in.coll.InsertMany(ctx, docs, options.InsertMany().SetOrdered(false))
	if err == nil {
		for i := range written {
			written[i] = true
		}
		in.tally(ctx, ids...)
		return written, false, nil
	}
	var bwe mongo.BulkWriteException
	if !errors.As(err, &bwe) || bwe.WriteConcernError != nil || len(bwe.WriteErrors) == 0 {
		// Nothing is known about single records; some may be in. A retry
		// of one that is finds its duplicate key and settles it.
		in.log.WarnContext(ctx, "inbox: writing buffered done records failed, retrying at the next flush",
			"message_id", ids[0], "records", len(ids), "error", err, "attempt", recs[0].attempts+1)
		return written, true, fmt.Errorf("inbox: write %d buffered done records: %w", len(ids), err)
	}
	failed := make(map[int]mongo.WriteError, len(bwe.WriteErrors))
	for _, we := range bwe.WriteErrors {
		failed[we.Index] = we.WriteError
	}
	var firstErr error
	inserted := make([]string, 0, len(ids))
	defer func() { in.tally(ctx, inserted...) }()
	for i, id := range ids {
		we, bad := failed[i]
		if !bad {
			written[i] = true
			inserted = append(inserted, id)
			continue
		}
		werr := error(we)
		if mongo.IsDuplicateKeyError(we) {
			settled, serr := in.settleDuplicate(ctx, id, recs[i].at)
			if settled {
				written[i] = true
				continue
			}
			werr = cmp.Or(serr, errors.New("record vanished after a duplicate key"))
		}
		in.log.WarnContext(ctx, "inbox: writing a buffered done record failed, retrying at the next flush",
			"message_id", id, "error", werr, "attempt", recs[i].attempts+1)
		firstErr = cmp.Or(firstErr, fmt.Errorf("inbox: write buffered done record %s: %w", id, werr))
	}
	return written, false, firstErr
}

// Close stops the background flusher and writes the buffered done records,
// retrying failed writes until they succeed or ctx ends; bound it with a
// deadline. It returns an error naming how many records were not written:
// those are lost when the process exits, which costs only a rerun of the
// (idempotent) handler if their messages are delivered again. After Close,
// Process writes each record before it returns, as without FlushInterval.
// Close is idempotent (a second call retries what the first could not
// write), and a no-op returning nil without FlushInterval.
func (in *Inbox) Close(ctx context.Context) error {
	b := in.buf
	if b == nil {
		return nil
	}
	b.mu.Lock()
	b.closed = true
	started := b.started
	b.mu.Unlock()
	if started {
		b.stopOnce.Do(func() { close(b.stop) })
		select {
		case <-b.done:
		case <-ctx.Done():
			return fmt.Errorf("inbox: close: waiting for the flusher: %w", ctx.Err())
		}
	}
	for attempt := 1; ; attempt++ {
		remaining, err := in.flush(ctx)
		if remaining == 0 {
			return nil
		}
		if err == nil {
			err = errors.New("records left")
		}
		if serr := sleep(ctx, min(10*time.Millisecond<<min(attempt-1, 16), maxFlushBackoff)); serr != nil {
			in.log.ErrorContext(ctx, "inbox: close: buffered done records not written",
				"records", remaining, "error", err, "attempt", attempt)
			return fmt.Errorf("inbox: close: %d buffered done records not written: %w (%w)", remaining, err, serr)
		}
	}
}

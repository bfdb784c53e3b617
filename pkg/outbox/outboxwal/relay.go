package outboxwal

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/headerjson"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxsql"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/relayhook"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/retry"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/vacuum"
)

// Relay publishes the outbox's rows as it reads their inserts from the
// write-ahead log. Run it in as many processes as you like: one streams from
// the slot, the others wait and take over when it stops.
type Relay struct {
	pool    *pgxpool.Pool
	pub     outbox.Publisher
	cfg     Config
	log     *slog.Logger
	running atomic.Bool

	mu      sync.Mutex
	current *state // the session streaming now, nil while waiting
	active  atomic.Bool
	acked   atomic.Uint64
}

// NewRelay returns a relay that publishes the outbox in pool's database (the
// schema of its search_path) through pub. It validates cfg and touches
// neither the database nor the broker: Run does. pool's connection settings
// are also used for the replication connection, which needs a role with the
// REPLICATION attribute (or a superuser).
func NewRelay(pool *pgxpool.Pool, pub outbox.Publisher, cfg Config) (*Relay, error) {
	if pool == nil {
		return nil, errors.New("outboxwal: nil pool")
	}
	if pub == nil {
		return nil, errors.New("outboxwal: nil publisher")
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Relay{pool: pool, pub: pub, cfg: cfg, log: cfg.Logger}, nil
}

// observe reports o to the Observer, if there is one.
// handOverPublisher is the publisher of the polling relay this relay runs
// for the rows it hands over: that relay claims only those
// (relayhook.HandOver).
type handOverPublisher struct{ outbox.Publisher }

func (handOverPublisher) HandOverOnly(relayhook.Token) {}

func (r *Relay) observe(ctx context.Context, o outbox.Observation) {
	if r.cfg.Observer != nil {
		r.cfg.Observer.Observe(ctx, o)
	}
}

// count reports n rows of kind k, when there are any.
func (r *Relay) count(ctx context.Context, k outbox.ObservationKind, n int) {
	if n > 0 {
		r.observe(ctx, outbox.Observation{Kind: k, N: n})
	}
}

// Stats is what a relay knows about its progress.
type Stats struct {
	// Active says this relay streams from the slot now (the others wait).
	Active bool
	// Acknowledged is the last position the relay acknowledged to the slot.
	Acknowledged uint64
	// InMemory counts events decoded and not yet confirmed, swept or handed
	// over.
	InMemory int
	// OldestUnconfirmedAge is how long ago the oldest event not yet
	// confirmed (or handed over) committed; 0 when there is none.
	OldestUnconfirmedAge time.Duration
}

// Stats returns the relay's progress. It is cheap: no database access.
func (r *Relay) Stats() Stats {
	st := Stats{Active: r.active.Load(), Acknowledged: r.acked.Load()}
	r.mu.Lock()
	s := r.current
	r.mu.Unlock()
	if s != nil {
		st.InMemory = s.inMemory()
		if t := s.oldest(); !t.IsZero() {
			st.OldestUnconfirmedAge = max(0, time.Since(t))
		}
	}
	return st
}

// Wake does nothing: the relay hears of every commit from the stream. It lets
// a WAL relay stand where code calls the polling relay's Wake after a commit.
func (r *Relay) Wake() {}

// Prepare creates the publication, the indexes and the slot when missing, as
// Run does at start, and returns. Run it from a deployment step to have the
// slot retain every event written from then on before any relay runs (rows
// already in the outbox when the slot is made are handed over to polling).
func (r *Relay) Prepare(ctx context.Context) error {
	if _, err := ensurePublication(ctx, r.pool, r.cfg.Publication); err != nil {
		return fmt.Errorf("outboxwal prepare: %w", err)
	}
	conn, err := pgconn.ConnectConfig(ctx, r.replicationConfig())
	if err != nil {
		return fmt.Errorf("outboxwal prepare: replication connection: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx)) //nolint:errcheck // nothing to do about it
	id, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		return fmt.Errorf("outboxwal prepare: identify the server: %w", err)
	}
	if _, _, err := r.ensureSlot(ctx, conn, serverName(id), true); err != nil {
		return fmt.Errorf("outboxwal prepare: %w", err)
	}
	return nil
}

// Run publishes until ctx is cancelled, then finishes the batches in flight,
// sweeps what they confirmed, acknowledges the slot and returns nil. It
// creates the publication and the slot when missing. While another relay
// streams from the slot, it waits, trying again every TakeoverInterval.
// Database, replication and broker outages do not make it return: it logs,
// reconnects, and resumes from the slot's acknowledged position (events
// after it are published again: duplicates, never losses). It returns an
// error only when called while already running.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("outboxwal: Run called while already running")
	}
	defer r.running.Store(false)
	r.log.InfoContext(ctx, "outbox WAL relay started", slog.String("slot", r.cfg.Slot), slog.String("publication", r.cfg.Publication))
	// Keep the publisher connected, also while waiting for the slot: a
	// takeover then needs no dial, and the publisher's readiness reports the
	// broker whether this relay streams or waits.
	var warm sync.WaitGroup
	defer warm.Wait()
	wctx, stopWarm := context.WithCancel(ctx)
	defer stopWarm()
	warm.Go(func() {
		for wctx.Err() == nil {
			_ = r.pub.WaitReady(wctx)
			retry.Sleep(wctx, time.Second)
		}
	})
	var failures int
	waiting := false
	for ctx.Err() == nil {
		progressed, err := r.session(ctx)
		if ctx.Err() != nil {
			break
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use: another relay has the slot
			if !waiting {
				r.log.InfoContext(ctx, "outbox WAL relay: the slot is in use by another relay; waiting to take over",
					slog.String("slot", r.cfg.Slot), slog.String("detail", pgErr.Message))
			}
			waiting = true
			r.awaitSlot(ctx)
			continue
		}
		waiting = false
		if progressed {
			failures = 0
		}
		failures++
		wait := retry.Jitter(retry.Backoff(failures, 100*time.Millisecond, 5*time.Second))
		r.log.ErrorContext(ctx, "outbox WAL relay: replication stopped, reconnecting",
			slog.Any("error", err), slog.Duration("retry_in", wait))
		retry.Sleep(ctx, wait)
	}
	r.log.InfoContext(context.WithoutCancel(ctx), "outbox WAL relay stopped")
	return nil
}

// awaitSlot returns once the slot is free (or missing, or its state cannot
// be read), looking every TakeoverInterval through the pool: a waiting relay
// opens no replication connection (a WAL sender process on the server) until
// it has a chance to take the slot.
func (r *Relay) awaitSlot(ctx context.Context) {
	for {
		retry.Sleep(ctx, r.cfg.TakeoverInterval)
		if ctx.Err() != nil {
			return
		}
		s, err := Slot(ctx, r.pool, r.cfg.Slot)
		if err != nil || !s.Active {
			return
		}
	}
}

// replicationConfig is pool's connection configuration for a replication
// connection.
func (r *Relay) replicationConfig() *pgconn.Config {
	c := r.pool.Config().ConnConfig.Config.Copy()
	c.RuntimeParams["replication"] = "database"
	c.RuntimeParams["DateStyle"] = "ISO"
	c.RuntimeParams["TimeZone"] = "UTC"
	return c
}

// session connects, takes the slot and streams until ctx ends or something
// breaks. progressed says it resolved an event or acknowledged a new
// position: a session that keeps failing without progress is retried with a
// growing backoff, not at once (each new session is a new WAL sender reading
// again from the slot's restart point).
func (r *Relay) session(ctx context.Context) (progressed bool, err error) {
	cctx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	schema, err := ensurePublication(cctx, r.pool, r.cfg.Publication)
	if err != nil {
		return false, err
	}
	conn, err := pgconn.ConnectConfig(cctx, r.replicationConfig())
	if err != nil {
		return false, fmt.Errorf("replication connection: %w", err)
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	id, err := pglogrepl.IdentifySystem(cctx, conn)
	if err != nil {
		return false, fmt.Errorf("identify the server: %w", err)
	}
	server := serverName(id)
	cancel()
	// The polling relay of handed-over rows runs from the start: rows a
	// backlog's listing hands over early (see listBacklog) go out while the
	// rest is listed.
	poller, err := outbox.NewRelay(r.pool, handOverPublisher{r.pub}, r.cfg.Poll)
	if err != nil {
		return false, fmt.Errorf("polling relay for handed-over rows: %w", err)
	}
	pctx, stopPoller := context.WithCancel(ctx)
	var polling sync.WaitGroup
	polling.Go(func() { _ = poller.Run(pctx) })
	defer func() {
		stopPoller()
		polling.Wait()
	}()
	created, bl, err := r.ensureSlot(ctx, conn, server, false)
	if err != nil {
		return false, err
	}
	adopting := false
	if !created {
		// Listed before the stream starts (a long listing would leave the
		// WAL sender unanswered), if the slot's recorded server is not this
		// one; takeSlot below reads it again under the slot's lock.
		var recorded string
		qctx, qcancel := context.WithTimeout(ctx, dbTimeout)
		err := r.pool.QueryRow(qctx, recordedServerSQL, r.cfg.Slot).Scan(&recorded)
		qcancel()
		if err != nil {
			return false, fmt.Errorf("read the slot's server: %w", err)
		}
		if recorded != server {
			// Every row committed before now is handed over, so the
			// slot's stream up to now carries nothing to publish: the
			// slot moves on to now before the listing (which sees every
			// row committed before it). Its stream could even be unusable:
			// an operator's slot made before the relay made the
			// publication holds changes that pgoutput cannot decode
			// ("publication does not exist" before PostgreSQL 18), at
			// every reconnect.
			if err := r.advanceSlot(ctx, server); err != nil {
				return false, err
			}
			if bl, err = listBacklog(ctx, r.pool, "", adoptedReason); err != nil {
				return false, err
			}
			adopting = true
		}
	}
	cctx, cancel = context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	err = pglogrepl.StartReplication(cctx, conn, r.cfg.Slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + r.cfg.Publication + "'"},
	})
	if err != nil {
		return false, fmt.Errorf("start replication from slot %s: %w", r.cfg.Slot, err)
	}
	// The slot is ours: any relay that streamed from it before has stopped
	// streaming. Its process may still run (a cut replication connection):
	// the new epoch fences it off, and waits for its last write to commit,
	// so everything it wrote is visible to the reads below.
	t, err := takeSlot(cctx, r.pool, r.cfg.Slot, server)
	if err != nil {
		return false, err
	}
	f := fence{slot: r.cfg.Slot, epoch: t.epoch, server: server}
	if !created && t.previous != server {
		// The slot's stream covers what committed after its position on
		// this server. Whether the rows in the outbox are all in it, only a
		// session that streamed from this very server could tell: after a
		// promotion, a restore or a switch to another server, or on a slot
		// an operator made, rows can sit in the outbox below the slot's
		// position. Polling publishes them, as for a new slot (see
		// backlog); until that hand-over is done, no session records this
		// server, so the next one hands them over again.
		if !adopting { // the server changed since it was read above
			if bl, err = listBacklog(ctx, r.pool, "", adoptedReason); err != nil {
				return false, err
			}
			cancel()
			cctx, cancel = context.WithTimeout(ctx, dbTimeout)
			defer cancel()
		}
		r.log.WarnContext(ctx, "outbox WAL relay: the slot's last session did not stream from this server; the rows in the outbox are handed over to polling",
			slog.String("slot", r.cfg.Slot), slog.String("server", server), slog.String("previous_server", t.previous),
			slog.Int("rows", len(bl.all)))
	}
	// Transactions that committed before now may have been seen by it.
	var boundary pglogrepl.LSN
	if err := r.pool.QueryRow(cctx, "SELECT pg_current_wal_insert_lsn()").Scan(&boundary); err != nil {
		return false, fmt.Errorf("read the WAL position: %w", err)
	}
	var held map[aggKey]bool
	if bl == nil { // a backlog's pins hold the aggregates of every row
		if held, err = loadHeld(cctx, r.pool); err != nil {
			return false, err
		}
	}
	cancel()

	s := newState(r.cfg, f, t.dispatched)
	s.setHeld(held, 0, false)
	s.backlog = bl
	r.mu.Lock()
	r.current = s
	r.mu.Unlock()
	r.active.Store(true)
	defer func() {
		r.active.Store(false)
		r.mu.Lock()
		r.current = nil
		r.mu.Unlock()
	}()
	r.log.InfoContext(ctx, "outbox WAL relay: streaming", slog.String("slot", r.cfg.Slot),
		slog.Int("aggregates_held", len(held)), slog.Int64("epoch", f.epoch), slog.String("server", server))

	sctx, stop := context.WithCancel(ctx)
	defer stop()
	var fenced atomic.Bool
	onFenced := func() {
		if fenced.CompareAndSwap(false, true) {
			r.log.WarnContext(ctx, "outbox WAL relay: another relay took the slot; this session stops at once and writes nothing more",
				slog.String("slot", r.cfg.Slot), slog.Int64("epoch", f.epoch))
		}
		stop()
	}
	var workers, helpers sync.WaitGroup
	for range r.cfg.Workers {
		workers.Go(func() { r.work(sctx, s, onFenced) })
	}
	vac := vacuum.New(r.pool, r.log, "outbox WAL relay", r.cfg.VacuumEvery)
	wctx, stopWriter := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWriter()
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		r.writer(wctx, sctx, s, poller, vac, onFenced)
	}()
	helpers.Go(func() { vac.Run(sctx) })
	helpers.Go(func() { r.refresh(sctx, s, bl) })
	if bl != nil {
		comment := ""
		if created {
			comment = slotComment(r.cfg.Slot, "ready")
		}
		helpers.Go(func() {
			if markBacklog(sctx, r.pool, bl, r.log) != nil {
				return
			}
			if r.finishBacklog(sctx, &f, server, comment) == nil {
				bl.marked.Store(true)
			}
		})
	}

	err = r.stream(sctx, conn, s, uint64(boundary), schema)

	// Wind down: no new batches; those in flight finish; what they confirmed
	// is swept; then the last acknowledgement.
	stop()
	workers.Wait()
	s.close()
	stopWriter()
	<-writerDone
	helpers.Wait()
	if fenced.Load() {
		return s.progressed(), errFenced
	}
	if err == nil || ctx.Err() != nil {
		if ferr := r.sendStatus(context.WithoutCancel(ctx), conn, s); ferr != nil && err == nil {
			err = ferr
		}
	}
	if ctx.Err() != nil {
		return s.progressed(), nil
	}
	return s.progressed(), err
}

// ensureSlot creates the slot when missing, and lists the rows already in the
// outbox then (its backlog, see backlog): the slot's stream starts after
// them. It says whether it created the slot. With prepare it also hands them
// over to polling and marks the slot ready; otherwise the session does,
// beside its stream.
//
// Creating the slot and handing over are two steps, and a relay may die
// between them; a relay that streamed from such a slot would publish later
// events of those rows' aggregates before them, and never publish the rows.
// So relays create slots one at a time, under an advisory lock held by a
// session of their own, and the publication's comment says that a relay is
// creating the slot (slotComment "creating") before it does, and that the
// slot is ready once the hand-over committed. A slot found with "creating",
// while holding the lock, was left half-made by a relay: it is dropped and
// made again. A slot without either mark was made by an operator: it is
// used as it is, never dropped (the session hands over what it may not
// cover, see session).
//
// A slot whose position is ahead of the server's WAL would skip every
// transaction committed below that position: the relay remakes it when a
// relay made it, and refuses an operator's. A slot PostgreSQL invalidated
// (wal_status = lost, past max_slot_wal_keep_size) can never be streamed
// from again and retains nothing: the relay remakes it, whoever made it.
//
// It returns errOtherServer, and closes the pool connection it used, when
// that connection reaches another server than server (the replication
// connection's): the pool then connects anew.
func (r *Relay) ensureSlot(parent context.Context, conn *pgconn.PgConn, server string, prepare bool) (created bool, bl *backlog, err error) {
	ctx, cancel := context.WithTimeout(parent, dbTimeout)
	defer cancel()
	c, err := r.pool.Acquire(ctx)
	if err != nil {
		return false, nil, fmt.Errorf("slot %s: %w", r.cfg.Slot, err)
	}
	defer c.Release()
	if err := onServer(ctx, c, server); err != nil {
		return false, nil, fmt.Errorf("slot %s: %w", r.cfg.Slot, err)
	}
	key := slotLockKey(r.cfg.Slot)
	if _, err := c.Exec(ctx, "SELECT pg_advisory_lock($1)", key); err != nil {
		c.Conn().PgConn().Close(context.WithoutCancel(ctx)) //nolint:errcheck // the lock dies with the session
		return false, nil, fmt.Errorf("slot %s: wait for the lock: %w", r.cfg.Slot, err)
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), dbTimeout)
		defer cancel()
		if _, err := c.Exec(uctx, "SELECT pg_advisory_unlock($1)", key); err != nil {
			c.Conn().PgConn().Close(uctx) //nolint:errcheck // the lock dies with the session
		}
	}()

	var (
		plugin, comment             string
		sameDB, exists, ahead, lost bool
	)
	err = c.QueryRow(ctx, `
SELECT s.slot_name IS NOT NULL, coalesce(s.plugin, ''), coalesce(s.database = current_database(), false),
       coalesce(obj_description(p.oid, 'pg_publication'), ''),
       coalesce(s.confirmed_flush_lsn > pg_current_wal_lsn(), false),
       coalesce(s.wal_status = 'lost', false)
FROM (SELECT 1) one
LEFT JOIN pg_replication_slots s ON s.slot_name = $1
LEFT JOIN pg_publication p ON p.pubname = $2`, r.cfg.Slot, r.cfg.Publication).Scan(&exists, &plugin, &sameDB, &comment, &ahead, &lost)
	if err != nil {
		return false, nil, fmt.Errorf("look for slot %s: %w", r.cfg.Slot, err)
	}
	ours := comment == slotComment(r.cfg.Slot, "ready") || comment == slotComment(r.cfg.Slot, "creating")
	switch {
	case exists && (plugin != "pgoutput" || !sameDB):
		return false, nil, fmt.Errorf("slot %s exists but is not a pgoutput logical slot of this database", r.cfg.Slot)
	case exists && lost:
		// PostgreSQL removed WAL the slot still needed (past
		// max_slot_wal_keep_size): nothing can be streamed from it, and it
		// retains nothing, so remaking it throws nothing away, an operator's
		// slot included. The new slot's backlog hands every row still in the
		// outbox over to polling: the rows written while the slot was lost
		// are among them.
		r.log.ErrorContext(ctx, "outbox WAL relay: the slot was invalidated by PostgreSQL (wal_status = lost: it retained more WAL than max_slot_wal_keep_size); making it again and handing the outbox's rows over to polling",
			slog.String("slot", r.cfg.Slot))
	case exists && ahead && !ours:
		return false, nil, fmt.Errorf("slot %s is ahead of the server's WAL: it would skip the transactions committed below its position; drop it (a relay then makes a new one)", r.cfg.Slot)
	case exists && ahead:
		r.log.ErrorContext(ctx, "outbox WAL relay: the slot is ahead of the server's WAL (it was acknowledged on another server); making it again",
			slog.String("slot", r.cfg.Slot))
	case exists && comment == slotComment(r.cfg.Slot, "creating"):
		r.log.WarnContext(ctx, "outbox WAL relay: the slot was left half-made (its creator stopped before handing over the rows older than it); making it again",
			slog.String("slot", r.cfg.Slot))
	case exists:
		return false, nil, nil
	}
	if exists {
		if _, err := c.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, r.cfg.Slot); err != nil {
			return false, nil, fmt.Errorf("drop slot %s to make it again: %w", r.cfg.Slot, err)
		}
	}
	if err := r.commentPublication(ctx, c, "creating"); err != nil {
		return false, nil, err
	}
	// Creating a logical slot waits for every transaction running on the
	// server, in any database, to end: its own deadline, longer than a
	// statement's, and a warning once it waits longer than one.
	cctx, ccancel := context.WithTimeout(parent, slotCreateTimeout)
	defer ccancel()
	slow := time.AfterFunc(dbTimeout, func() {
		r.log.WarnContext(cctx, "outbox WAL relay: creating the slot waits for the transactions running on the server (in any database) to end",
			slog.String("slot", r.cfg.Slot), slog.Duration("waited", dbTimeout), slog.Duration("limit", slotCreateTimeout))
	})
	res, err := pglogrepl.CreateReplicationSlot(cctx, conn, r.cfg.Slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
		Mode: pglogrepl.LogicalReplication, SnapshotAction: "EXPORT_SNAPSHOT",
	})
	slow.Stop()
	if err != nil {
		return false, nil, fmt.Errorf("create slot %s: %w", r.cfg.Slot, err)
	}
	// The rows older than the slot, read in its snapshot, in steps of their
	// own deadline (see backlog). A session marks them beside its stream;
	// Prepare, which streams nothing, marks them here.
	bl, err = listBacklog(parent, r.pool, res.SnapshotName, preexistingReason)
	if err == nil && prepare {
		if err = markBacklog(parent, r.pool, bl, r.log); err == nil {
			err = r.finishBacklog(parent, nil, server, slotComment(r.cfg.Slot, "ready"))
		}
	}
	if err != nil {
		// Without the listing, rows older than the slot would never be
		// published: start over with a new slot. The rows handed over stay so.
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(parent), dbTimeout)
		defer dcancel()
		if _, derr := c.Exec(dctx, `SELECT pg_drop_replication_slot($1)`, r.cfg.Slot); derr != nil {
			err = errors.Join(err, fmt.Errorf("drop the new slot: %w", derr))
		}
		return false, nil, err
	}
	r.log.InfoContext(ctx, "outbox WAL relay: created the replication slot", slog.String("slot", r.cfg.Slot),
		slog.String("consistent_point", res.ConsistentPoint), slog.Int("rows_older_than_it", len(bl.toMark)))
	return true, bl, nil
}

// advanceSlot moves the slot on to the current WAL position of server (of
// the replication connection: a pool connection on another server is closed,
// errOtherServer). Under its own deadline: the server reads the WAL from the
// slot's restart point to there.
func (r *Relay) advanceSlot(ctx context.Context, server string) error {
	actx, cancel := context.WithTimeout(ctx, slotCreateTimeout)
	defer cancel()
	c, err := r.pool.Acquire(actx)
	if err != nil {
		return fmt.Errorf("move slot %s on: %w", r.cfg.Slot, err)
	}
	defer c.Release()
	if err := onServer(actx, c, server); err != nil {
		return fmt.Errorf("move slot %s on: %w", r.cfg.Slot, err)
	}
	if _, err := c.Exec(actx, advanceSlotSQL, r.cfg.Slot); err != nil {
		return fmt.Errorf("move slot %s on to the current WAL position: %w", r.cfg.Slot, err)
	}
	return nil
}

// commentPublication records the state of the slot's creation as the
// publication's comment.
func (r *Relay) commentPublication(ctx context.Context, c *pgxpool.Conn, state string) error {
	_, err := c.Exec(ctx, "COMMENT ON PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+" IS '"+slotComment(r.cfg.Slot, state)+"'")
	if err != nil {
		return fmt.Errorf("mark slot %s %s: %w", r.cfg.Slot, state, err)
	}
	return nil
}

// slotComment is the publication's comment while a relay makes slot
// (state "creating") and once it is ready (state "ready").
func slotComment(slot, state string) string {
	return "outboxwal: slot " + slot + " " + state
}

// slotLockKey is the advisory lock that serialises the creation of slot.
func slotLockKey(slot string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("outboxwal slot " + slot))
	return int64(h.Sum64())
}

// stream reads the replication stream until ctx ends or it fails, and
// acknowledges progress every StatusInterval.
//
// Changes of other tables than schema's outbox (a table added to the
// publication behind the relay's back) are skipped. A row it cannot decode
// (a column renamed, a header of the wrong type inserted by hand) is
// dead-lettered by id when its turn comes, not retried for ever.
func (r *Relay) stream(ctx context.Context, conn *pgconn.PgConn, s *state, boundary uint64, schema string) error {
	relations := map[uint32]*relation{}
	foreign := map[uint32]bool{}
	types := pgtype.NewMap()
	var cur *txn
	var curCheck bool
	nextStatus := time.Now()

	// The reads are bounded by the socket's read deadline, set once per status
	// interval, not by a context per message: a context with a deadline, and
	// the client's watch of it, cost a timer and an AfterFunc for every
	// message of the stream. The end of ctx moves the deadline to now; the
	// check of ctx after each setting of the deadline closes the race with it.
	sock := conn.Conn()
	stopWatch := context.AfterFunc(ctx, func() { _ = sock.SetReadDeadline(time.Now()) })
	defer func() {
		if stopWatch() {
			_ = sock.SetReadDeadline(time.Time{})
		}
	}()
	var readDeadline time.Time
	for {
		if time.Now().After(nextStatus) {
			if err := r.sendStatus(ctx, conn, s); err != nil {
				return err
			}
			nextStatus = time.Now().Add(r.cfg.StatusInterval)
		}
		if s.full() {
			retry.Sleep(ctx, 5*time.Millisecond)
			if ctx.Err() != nil {
				return nil
			}
			continue
		}
		if !readDeadline.Equal(nextStatus) {
			if err := sock.SetReadDeadline(nextStatus); err != nil {
				return fmt.Errorf("receive: %w", err)
			}
			readDeadline = nextStatus
		}
		if ctx.Err() != nil {
			return nil
		}
		msg, err := conn.ReceiveMessage(context.Background())
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("receive: %w", err)
		}
		switch msg := msg.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("replication stream: %w", pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.CopyDone:
			return errors.New("replication stream ended by the server")
		case *pgproto3.CopyData:
			if len(msg.Data) == 0 {
				continue
			}
			switch msg.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
				if err != nil {
					return fmt.Errorf("parse keepalive: %w", err)
				}
				if cur == nil {
					s.position(uint64(pkm.ServerWALEnd))
				}
				if pkm.ReplyRequested {
					nextStatus = time.Time{}
				}
			case pglogrepl.XLogDataByteID:
				xld, err := pglogrepl.ParseXLogData(msg.Data[1:])
				if err != nil {
					return fmt.Errorf("parse XLogData: %w", err)
				}
				lm, err := pglogrepl.Parse(xld.WALData)
				if err != nil {
					return fmt.Errorf("parse logical message: %w", err)
				}
				switch m := lm.(type) {
				case *pglogrepl.RelationMessage:
					if m.Namespace != schema || m.RelationName != "outbox" {
						foreign[m.RelationID] = true
						delete(relations, m.RelationID)
						continue
					}
					delete(foreign, m.RelationID)
					relations[m.RelationID] = newRelation(m)
				case *pglogrepl.BeginMessage:
					cur = s.begin(m.CommitTime, m.Xid, uint64(m.FinalLSN))
					curCheck = uint64(m.FinalLSN) < boundary
				case *pglogrepl.InsertMessage:
					if foreign[m.RelationID] {
						continue
					}
					rel := relations[m.RelationID]
					if rel == nil || cur == nil {
						return fmt.Errorf("insert into unknown relation %d", m.RelationID)
					}
					env, err := rel.decode(types, m.Tuple)
					if err != nil && env.ID == 0 {
						return fmt.Errorf("decode outbox row: %w", err)
					}
					if err != nil {
						r.log.ErrorContext(ctx, "outbox WAL relay: cannot decode an outbox row; it is dead-lettered", append(logAttrs(env), slog.Any("error", err))...)
						s.addUndecodable(cur, env, "the WAL relay cannot decode the row: "+err.Error())
						continue
					}
					s.add(cur, env, curCheck)
				case *pglogrepl.CommitMessage:
					if cur != nil {
						s.seal(cur, uint64(m.TransactionEndLSN))
						cur = nil
					}
				}
			}
		default:
			return fmt.Errorf("unexpected message %T on the replication stream", msg)
		}
	}
}

// sendStatus acknowledges the position below which every event is resolved.
// It only ever sends a position the session read from its own stream: one
// from an earlier session may belong to another server (a switchover), whose
// slot would then skip every transaction below it.
//
// Before the session has anything to acknowledge, it still answers, with no
// position (which moves nothing): a WAL sender that hears nothing for
// wal_sender_timeout ends the connection.
func (r *Relay) sendStatus(ctx context.Context, conn *pgconn.PgConn, s *state) error {
	pos := s.ack()
	err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pglogrepl.LSN(pos)})
	if err != nil {
		return fmt.Errorf("send standby status: %w", err)
	}
	if pos == 0 {
		return nil
	}
	r.acked.Store(pos)
	if h, ok := r.cfg.Observer.(relayhook.Acknowledged); ok {
		h.Acknowledged(ctx, relayhook.LSN(pos))
	}
	return nil
}

// work publishes ready events in batches until ctx ends, or until the session
// is fenced off (onFenced).
func (r *Relay) work(ctx context.Context, s *state, onFenced func()) {
	for ctx.Err() == nil {
		if err := r.pub.WaitReady(ctx); err != nil {
			if ctx.Err() == nil {
				r.log.ErrorContext(ctx, "outbox WAL relay: publisher unavailable", slog.Any("error", err))
				retry.Sleep(ctx, time.Second)
			}
			continue
		}
		batch := s.take(r.cfg.BatchSize)
		if len(batch) == 0 {
			s.waitWork(ctx, 100*time.Millisecond)
			continue
		}
		if err := r.publish(context.WithoutCancel(ctx), s, batch); errors.Is(err, errFenced) {
			onFenced()
			return
		}
	}
}

// notRecordedDelay is how long an event waits when the statement that must
// precede its attempt failed (the database is unreachable, say).
const notRecordedDelay = 200 * time.Millisecond

// notVisibleDelay is how long an event waits before its transaction's
// visibility is checked again.
const notVisibleDelay = 20 * time.Millisecond

// publish sends one batch and records its outcome. It returns errFenced, and
// sends nothing, when another session holds the slot.
func (r *Relay) publish(ctx context.Context, s *state, batch []*event) error {
	start := time.Now()
	batch = slices.DeleteFunc(batch, func(ev *event) bool {
		if ev.undecodable != "" {
			s.handAll(ev, true, ev.undecodable, 0)
			r.count(ctx, outbox.KindDeadLettered, 1)
		}
		return ev.undecodable != ""
	})
	if len(batch) == 0 {
		return nil
	}
	// Nothing goes out before other sessions can see its transaction: one
	// still waiting for a synchronous standby may yet be lost by a failover.
	vctx, cancel := context.WithTimeout(ctx, dbTimeout)
	hidden, err := notVisible(vctx, r.pool, s.fence, batch)
	cancel()
	if errors.Is(err, errFenced) {
		return err
	}
	if err != nil {
		r.log.WarnContext(ctx, "outbox WAL relay: could not tell whether the batch's transactions are visible; the batch waits", slog.Any("error", err))
		s.drop(batch, notRecordedDelay)
		return nil
	}
	if len(hidden) > 0 {
		// With the rest of their runs: a later event never goes out
		// without the earlier ones of its run.
		out := s.drop(hidden, notVisibleDelay)
		batch = slices.DeleteFunc(batch, func(ev *event) bool { return out[ev] })
		if len(batch) == 0 {
			return nil
		}
	}
	// First the fence and the dispatched position: nothing is sent unless
	// this session still holds the slot, and a later session will know that
	// these events may have been in flight.
	var top uint64
	for _, ev := range batch {
		top = max(top, ev.tx.final)
	}
	mctx, cancel := context.WithTimeout(ctx, dbTimeout)
	err = markDispatched(mctx, r.pool, s.fence, top)
	cancel()
	if errors.Is(err, errFenced) {
		return err
	}
	if err != nil {
		r.log.WarnContext(ctx, "outbox WAL relay: could not record the dispatched position; the batch waits", slog.Any("error", err))
		s.drop(batch, notRecordedDelay)
		return nil
	}
	if slices.ContainsFunc(batch, func(ev *event) bool { return ev.check }) {
		cctx, cancel := context.WithTimeout(ctx, dbTimeout)
		found, err := r.checkRows(cctx, s.fence, batch)
		cancel()
		if errors.Is(err, errFenced) {
			return err
		}
		if err != nil {
			// They wait: published unchecked, an event an earlier session
			// had in flight when it stopped would go out with batch-mates,
			// which it may take down with it.
			r.log.WarnContext(ctx, "outbox WAL relay: could not check rows decoded from before this session; they wait", slog.Any("error", err))
			batch = slices.DeleteFunc(batch, func(ev *event) bool {
				if ev.check {
					s.retryLater(ev, notRecordedDelay)
				}
				return ev.check
			})
		} else {
			var keep, gone, leave []*event
			handed := map[aggKey]bool{}
			for _, ev := range batch {
				row, present := found[ev.env.ID]
				switch {
				case !ev.check:
					keep = append(keep, ev)
				case ev.taken && (!present || row.HandedOver):
					// Behind its head in a run: it leaves the batch with
					// the rest of the run, and is checked again as a head.
					leave = append(leave, ev)
				case !present:
					gone = append(gone, ev)
				case row.HandedOver:
					s.handAll(ev, false, "", 0) // with the rest of its run
					handed[ev.key] = true
				case ev.suspect && row.InFlight:
					// An earlier session recorded an attempt and stopped
					// before its outcome: it may be what stops relays.
					ev.check, ev.alone = false, true
					keep = append(keep, ev)
				default:
					ev.check = false
					keep = append(keep, ev)
				}
			}
			s.gone(gone)
			out := s.drop(leave, 0)
			batch = slices.DeleteFunc(keep, func(ev *event) bool { return out[ev] || handed[ev.key] })
		}
	}
	var alone []*event
	batch = slices.DeleteFunc(batch, func(ev *event) bool {
		if ev.alone {
			alone = append(alone, ev)
		}
		return ev.alone
	})
	// The attempts are recorded under solo too: an attempt recorded while an
	// event goes out alone would be charged for the crash that one causes.
	if len(batch) > 0 {
		s.solo.RLock()
		batch, err = r.recordAttempts(ctx, s, batch)
		if err == nil && len(batch) > 0 {
			r.send(ctx, s, batch, start)
		}
		s.solo.RUnlock()
		if err != nil {
			return err
		}
	}
	// Each alone, with nothing else in flight, its attempt recorded just
	// before it is made: if it stops the relay, no other event is charged.
	for _, ev := range alone {
		s.solo.Lock()
		one, err := r.recordAttempts(ctx, s, []*event{ev})
		if err == nil && len(one) > 0 {
			r.send(ctx, s, one, time.Now())
		}
		s.solo.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

// recordAttempts records in PostgreSQL the attempts about to be made of the
// batch's suspect events and of every retry, so that a relay that stops
// during them (a crash, a kill) leaves them counted. It returns the events to
// publish now. A suspect event whose earlier attempts reached MaxAttempts
// without an outcome is dead-lettered instead of published again; events
// whose record could not be written wait and are tried again later.
//
// It returns errFenced, and nothing to publish, once another session holds
// the slot.
func (r *Relay) recordAttempts(ctx context.Context, s *state, batch []*event) ([]*event, error) {
	need := func(ev *event) bool { return (ev.suspect || ev.failures > 0) && !ev.recorded }
	var ids []int64
	for _, ev := range batch {
		if need(ev) {
			ids = append(ids, ev.env.ID)
		}
	}
	if len(ids) == 0 {
		return batch, nil
	}
	rctx, cancel := context.WithTimeout(ctx, dbTimeout)
	recs, err := recordAttempts(rctx, r.pool, s.fence, ids)
	cancel()
	if errors.Is(err, errFenced) {
		return nil, err
	}
	if err != nil {
		r.log.WarnContext(ctx, "outbox WAL relay: could not record attempts; those events wait", slog.Any("error", err),
			slog.Int("events", len(ids)))
	}
	var out []*event
	dead := 0
	for _, ev := range batch {
		if !need(ev) {
			out = append(out, ev)
			continue
		}
		if err != nil {
			s.retryLater(ev, notRecordedDelay)
			continue
		}
		rec, ok := recs[ev.env.ID]
		if !ok {
			// Handed over or gone since the check: publish it as before, a
			// duplicate at worst.
			out = append(out, ev)
			continue
		}
		ev.recorded = true
		// Every attempt but an event's very first is recorded, so the
		// attempts before this one are rec.Attempts.
		ev.failures = max(ev.failures, rec.Attempts)
		if ev.failures < r.cfg.MaxAttempts {
			out = append(out, ev)
			continue
		}
		dead++
		reason := fmt.Sprintf("no outcome after attempt %d of %d: the relay stopped (crashed, was killed or lost its connection) while publishing it",
			ev.failures, r.cfg.MaxAttempts)
		env := ev.env
		env.Attempt = ev.failures
		r.log.ErrorContext(ctx, "outbox event dead-lettered: relays kept stopping while publishing it; its aggregate is handed over to polling",
			append(logAttrs(env), slog.String("error", reason))...)
		s.handAll(ev, true, reason, 0)
	}
	r.count(ctx, outbox.KindDeadLettered, dead)
	return out, nil
}

// send publishes events in one PublishBatch and records the outcomes.
func (r *Relay) send(ctx context.Context, s *state, batch []*event, start time.Time) {
	envs := make([]outbox.Envelope, len(batch))
	for i, ev := range batch {
		envs[i] = ev.env
		envs[i].Attempt = ev.failures + 1
	}
	pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	results := r.pub.PublishBatch(pctx, envs)
	cancel()
	r.observe(ctx, outbox.Observation{Kind: outbox.KindConfirmLatency, Duration: time.Since(start)})
	if len(results) != len(envs) {
		err := fmt.Errorf("outboxwal: publisher returned %d results for %d messages", len(results), len(envs))
		results = make([]error, len(envs))
		for i := range results {
			results[i] = err
		}
	}
	var confirmed, notSent []*event
	var handOver []func() // after the confirms: each hands over an aggregate's head
	var unrecord []int64
	var failed, returned, dead int
	// broken are the aggregates whose run in this batch had an event fail
	// or not go out: their later events count as unconfirmed, whatever the
	// broker said. After a failure they are handed over with it (handAll),
	// and polling publishes them again after it; after ErrNotSent they wait
	// behind it.
	broken := map[aggKey]bool{}
	for i, ev := range batch {
		err := results[i]
		if broken[ev.key] {
			continue
		}
		if errors.Is(err, outbox.ErrNotSent) {
			// Not attempted: a recorded attempt is still to be made.
			broken[ev.key] = true
			notSent = append(notSent, ev)
			continue
		}
		wasRecorded := ev.recorded
		ev.recorded, ev.alone = false, false
		if err == nil {
			confirmed = append(confirmed, ev)
			if wasRecorded {
				unrecord = append(unrecord, ev.env.ID)
			}
			continue
		}
		broken[ev.key] = true
		attrs := append(logAttrs(envs[i]), slog.Any("error", err))
		failed++
		if errors.Is(err, outbox.ErrUnroutable) {
			returned++
		}
		ev.failures++
		if ev.failures >= r.cfg.MaxAttempts {
			dead++
			r.log.ErrorContext(ctx, "outbox event dead-lettered after its last attempt; its aggregate is handed over to polling", attrs...)
			handOver = append(handOver, func() { s.handAll(ev, true, err.Error(), 0) })
			continue
		}
		// The event leaves the stream with the rest of its aggregate: the
		// polling relay retries it, with its backoff and attempts, and
		// publishes the aggregate's later events after it, while the stream
		// and the slot move on. Retried here, it would hold its aggregate's
		// later events in memory until they filled MaxInMemory, and then
		// stop the stream for every aggregate, pinning the server's WAL.
		added := 1
		if wasRecorded {
			added = 0 // the attempt is in the row already
		}
		r.log.WarnContext(ctx, "outbox event publish failed; its aggregate is handed over to polling, which retries it", attrs...)
		handOver = append(handOver, func() { s.handAll(ev, false, outboxsql.ErrorText(err.Error()), added) })
	}
	if len(unrecord) > 0 {
		// A recorded attempt that was confirmed is no failure: should this
		// relay stop before the row is swept, the next one must not count
		// it against the event.
		uctx, cancel := context.WithTimeout(ctx, dbTimeout)
		if err := unrecordAttempts(uctx, r.pool, s.fence, unrecord); err != nil && !errors.Is(err, errFenced) {
			r.log.WarnContext(ctx, "outbox WAL relay: could not record confirms of recorded attempts", slog.Any("error", err))
		}
		cancel()
	}
	if len(confirmed) > 0 {
		if h, ok := r.cfg.Observer.(relayhook.Confirmed); ok {
			ids := make(relayhook.IDs, len(confirmed))
			for i, ev := range confirmed {
				ids[i] = ev.env.ID
			}
			slices.Sort(ids)
			h.Confirmed(ctx, ids)
		}
		r.count(ctx, outbox.KindPublished, len(confirmed))
	}
	// In batch order, so a run's confirmed events are its aggregate's heads
	// in turn; then the event that failed or did not go out is the head.
	s.confirmed(confirmed)
	s.drop(notSent, 10*time.Millisecond)
	for _, f := range handOver {
		f()
	}
	r.count(ctx, outbox.KindFailed, failed)
	r.count(ctx, outbox.KindReturned, returned)
	r.count(ctx, outbox.KindDeadLettered, dead)
	r.observe(ctx, outbox.Observation{Kind: outbox.KindBatchDuration, Duration: time.Since(start)})
}

// writer sweeps confirmed rows and writes hand-overs every SweepInterval,
// until wctx ends; it then writes what is left, once. While sctx lasts, it
// wakes the poller after a hand-over. Once the session is fenced off, it
// writes nothing more.
func (r *Relay) writer(wctx, sctx context.Context, s *state, poller *outbox.Relay, vac *vacuum.Vacuumer, onFenced func()) {
	t := time.NewTicker(r.cfg.SweepInterval)
	defer t.Stop()
	var failures int
	fenced := false
	flush := func(ctx context.Context) bool {
		for !fenced && s.pendingWrites() > 0 {
			sweep, hand := s.takeWrites(sweepChunk)
			dctx, cancel := context.WithTimeout(ctx, dbTimeout)
			res, err := write(dctx, r.pool, s.fence, r.cfg.Archive, sweep, hand)
			cancel()
			if errors.Is(err, errFenced) {
				fenced = true
				onFenced()
				return false
			}
			if err != nil {
				s.writeFailed(sweep, hand)
				r.observe(ctx, outbox.Observation{Kind: outbox.KindMarkFailed})
				failures++
				r.log.ErrorContext(ctx, "outbox WAL relay: could not sweep or hand over rows", slog.Any("error", err),
					slog.Int("rows", len(sweep)+len(hand)))
				return false
			}
			failures = 0
			s.written(res)
			vac.Counted(len(res.swept))
			r.count(ctx, KindSwept, len(res.swept))
			if len(res.handed) > 0 {
				poller.Wake()
			}
			if len(res.skipped) > 0 || len(res.postponed) > 0 {
				return true // locked by a writer for a moment: next tick
			}
		}
		return true
	}
	for {
		select {
		case <-wctx.Done():
			// The session ends: what the workers confirmed is swept before the
			// last acknowledgement, within a bound.
			fctx, cancel := context.WithTimeout(context.Background(), dbTimeout)
			for i := 0; i < 20 && !fenced && s.pendingWrites() > 0 && fctx.Err() == nil; i++ {
				if !flush(fctx) {
					break
				}
				if s.pendingWrites() > 0 {
					retry.Sleep(fctx, 20*time.Millisecond)
				}
			}
			cancel()
			return
		case <-t.C:
			if failures > 0 {
				retry.Sleep(wctx, retry.Jitter(retry.Backoff(failures, 100*time.Millisecond, 5*time.Second)))
			}
			flush(wctx)
		}
	}
}

// refresh keeps the set of held aggregates up to date: aggregates whose
// handed-over rows were all published or discarded are released, so their
// next events are published from the stream again. While the session hands
// a backlog over (bl), nothing is released: once every listed row is handed
// over and has left the table or been dead-lettered, the aggregates with
// handed-over rows are held and the backlog's pins dropped.
func (r *Relay) refresh(ctx context.Context, s *state, bl *backlog) {
	every := r.cfg.Poll.PollInterval
	if every <= 0 {
		every = time.Second
	}
	for {
		retry.Sleep(ctx, every)
		if ctx.Err() != nil {
			return
		}
		if bl != nil {
			if !bl.marked.Load() {
				continue
			}
			done, err := releaseStep(ctx, r.pool, bl)
			if err == nil && done {
				qctx, cancel := context.WithTimeout(ctx, dbTimeout)
				var present map[aggKey]bool
				present, err = loadHeld(qctx, r.pool)
				cancel()
				if err == nil {
					s.setHeld(present, 0, false)
					s.unpin()
					if len(bl.all) > 0 {
						r.log.InfoContext(ctx, "outbox WAL relay: every row the slot does not cover was published; their aggregates' events come from the stream again",
							slog.String("slot", r.cfg.Slot), slog.Int("aggregates_held", len(present)))
					}
					bl = nil
				}
			}
			if err != nil && ctx.Err() == nil {
				r.log.WarnContext(ctx, "outbox WAL relay: could not look up the rows handed over", slog.Any("error", err))
			}
			continue
		}
		any, gen := s.heldSnapshot()
		if !any {
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, dbTimeout)
		present, err := loadHeld(qctx, r.pool)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				r.log.WarnContext(ctx, "outbox WAL relay: could not refresh the aggregates handed over", slog.Any("error", err))
			}
			continue
		}
		s.setHeld(present, gen, true)
	}
}

// relation maps the outbox table's columns as the stream sends them.
type relation struct {
	cols map[string]int
	oids []uint32
}

func newRelation(m *pglogrepl.RelationMessage) *relation {
	r := &relation{cols: map[string]int{}}
	for i, c := range m.Columns {
		r.cols[c.Name] = i
		r.oids = append(r.oids, c.DataType)
	}
	return r
}

// decode turns an inserted tuple into an envelope.
func (rel *relation) decode(types *pgtype.Map, t *pglogrepl.TupleData) (outbox.Envelope, error) {
	var e outbox.Envelope
	col := func(name string) ([]byte, error) {
		i, ok := rel.cols[name]
		if !ok || i >= len(t.Columns) {
			return nil, fmt.Errorf("column %s missing", name)
		}
		c := t.Columns[i]
		if c.DataType != pglogrepl.TupleDataTypeText {
			return nil, fmt.Errorf("column %s: no value in text form (%c)", name, c.DataType)
		}
		return c.Data, nil
	}
	var err error
	field := func(name string, f func([]byte) error) {
		if err != nil {
			return
		}
		b, cerr := col(name)
		if cerr != nil {
			err = cerr
			return
		}
		if ferr := f(b); ferr != nil {
			err = fmt.Errorf("column %s: %w", name, ferr)
		}
	}
	field("id", func(b []byte) (err error) { e.ID, err = strconv.ParseInt(string(b), 10, 64); return })
	field("aggregate_type", func(b []byte) error { e.AggregateType = string(b); return nil })
	field("aggregate_id", func(b []byte) error { e.AggregateID = string(b); return nil })
	field("aggregate_version", func(b []byte) (err error) {
		e.AggregateVersion, err = strconv.ParseInt(string(b), 10, 64)
		return
	})
	field("event_type", func(b []byte) error { e.EventType = string(b); return nil })
	field("payload", func(b []byte) error { e.Payload = b; return nil })
	field("headers", func(b []byte) (err error) { e.Headers, err = headerjson.Decode(b); return })
	field("created_at", func(b []byte) error {
		var ts pgtype.Timestamptz
		if err := types.Scan(pgtype.TimestamptzOID, pgtype.TextFormatCode, b, &ts); err != nil {
			return err
		}
		e.CreatedAt = ts.Time
		return nil
	})
	if err != nil {
		return e, err // what was decoded before the error, for a dead letter
	}
	if e.Headers == nil {
		e.Headers = map[string]string{}
	}
	return e, nil
}

// logAttrs returns the attributes the relays log e with.
func logAttrs(e outbox.Envelope) []any {
	return relayhook.LogAttrs(e.ID, e.AggregateType, e.AggregateID, e.AggregateVersion, e.EventType, e.Attempt)
}

package e2e

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// migrationUnderLoad runs `orders migrate` on the run's database (up to
// date: it must change nothing and block nobody), then the next release's
// (Binaries.OrdersNext: one more outbox schema version, a nullable column
// and an index) on the same database, while the load, the relays and the
// scrapes go on, and a reader keeps a transaction open on the outbox table
// a moment at a time (the column's table lock waits behind it, a
// lock_timeout at a time). The services, built for the version before,
// keep running on the new schema, and start on it after later faults. The
// checker reports the API's p99 while this lasts.
func (in *injector) migrationUnderLoad(ctx context.Context, f *chaos.Fault, record func(string)) error {
	c := in.c
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Minute)
	defer cancel()
	env := c.orders.spec.env
	t0 := time.Now()
	if out, err := c.run(ctx, c.orders.spec.bin, env, "migrate"); err != nil {
		return fmt.Errorf("orders migrate (up to date): %w\n%s", err, out)
	}
	upToDate := time.Since(t0)

	// The reader: a transaction at a time on the outbox table, each held
	// open a while, until the migration is over.
	readerCtx, stopReader := context.WithCancel(ctx)
	var (
		wg      sync.WaitGroup
		reads   int
		readErr error
	)
	wg.Go(func() {
		for readerCtx.Err() == nil {
			err := pgx.BeginFunc(readerCtx, c.db, func(tx pgx.Tx) error {
				_, err := tx.Exec(readerCtx, `SELECT count(*) FROM outbox`)
				sleep(readerCtx, 200*time.Millisecond)
				return err
			})
			switch {
			case err == nil:
				reads++
			case readerCtx.Err() == nil:
				readErr = fmt.Errorf("reader of the outbox: %w", err)
				return
			}
			sleep(readerCtx, 20*time.Millisecond)
		}
	})
	time.Sleep(300 * time.Millisecond) // the reader holds its first transaction
	t1 := time.Now()
	out, err := c.run(ctx, c.ordersNext, env, "migrate")
	next := time.Since(t1)
	stopReader()
	wg.Wait()
	if err != nil {
		return fmt.Errorf("orders migrate (next schema version): %w\n%s", err, out)
	}
	if readErr != nil {
		return readErr
	}
	var marker string
	var column, index bool
	err = c.db.QueryRow(ctx, `SELECT obj_description('outbox'::regclass, 'pg_class'),
		EXISTS (SELECT FROM pg_attribute WHERE attrelid = 'outbox'::regclass AND attname = 'next_note' AND NOT attisdropped),
		coalesce((SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('outbox_next_created_at')), false)`).Scan(&marker, &column, &index)
	switch {
	case err != nil:
		return fmt.Errorf("read the migrated outbox: %w", err)
	case !column || !index || !strings.HasPrefix(marker, "pkg/outbox schema 2;"):
		return fmt.Errorf("orders migrate did not apply the next schema version: column %v, valid index %v, marker %q", column, index, marker)
	}
	if out, err := c.run(ctx, c.orders.spec.bin, env, "outbox-status"); err != nil {
		return fmt.Errorf("orders of the version before, on the next schema: %w\n%s", err, out)
	}
	f.Measures = map[string]float64{
		chaos.MeasureMigrateSeconds: upToDate.Seconds(), chaos.MeasureNextMigrationSeconds: next.Seconds(),
		"reader_transactions": float64(reads),
	}
	record(fmt.Sprintf("orders migrate: up to date in %.1fs; the next schema version beside a reader (%d transactions) in %.1fs",
		upToDate.Seconds(), reads, next.Seconds()))
	return nil
}

// massKillBatch is the relays' batch size during relay_mass_kill: large
// batches, so that the relays have many rows in flight when they die.
const massKillBatch = 1000

// relayMassKill stops every relay, creates a backlog of
// chaos.MassKillBacklog orders, starts the relays with large batches and
// SIGKILLs them all at once as soon as they publish, with the backlog still
// in flight; restarts them and times the drain. Then the same backlog again,
// drained without a kill, for the comparison. It holds the relays and the
// database: no other fault on them skews the two times.
func (in *injector) relayMassKill(ctx context.Context, f *chaos.Fault, record func(string)) error {
	c := in.c
	if len(c.relays) == 0 {
		return errors.New("relay_mass_kill needs standalone relays")
	}
	if in.burst == nil {
		return errors.New("relay_mass_kill: no workload to create the backlog")
	}
	defer in.lock("postgres")()
	for _, p := range c.relays {
		defer in.lock(p.spec.name)()
	}
	ctx = context.WithoutCancel(ctx) // relays stopped are started again
	f.Start = time.Now()
	m := make(map[string]float64)
	tag := strconv.FormatInt(f.Start.UnixNano(), 36) // keys of their own
	killed, err := in.drainBacklog(ctx, "mk"+tag, true, m)
	if err == nil {
		var clean time.Duration
		clean, err = in.drainBacklog(ctx, "mc"+tag, false, m)
		m[chaos.MeasureDrainClean] = clean.Seconds()
	}
	m[chaos.MeasureDrainAfterKill] = killed.Seconds()
	// Back to the relays' own settings.
	for _, p := range c.relays {
		p.stop()
		err = errors.Join(err, p.ensureRunning())
	}
	for _, p := range c.relays {
		err = errors.Join(err, p.waitReady(ctx, time.Minute))
	}
	if err != nil {
		return err
	}
	f.Measures = m
	record(fmt.Sprintf("%d relays SIGKILLed with %.0f of %.0f backlog rows unpublished (%.0f claimed by a polling relay): drained in %.1fs (%.1fs after the restart); the same backlog (%.0f rows) drained cleanly in %.1fs",
		len(c.relays), m[chaos.MeasureInFlightAtKill], m[chaos.MeasureBacklog], m[chaos.MeasureClaimedAtKill],
		m[chaos.MeasureDrainAfterKill], m[chaos.MeasureRestartToDrain], m[chaos.MeasureCleanBacklog], m[chaos.MeasureDrainClean]))
	return nil
}

// drainBacklog stops the relays, creates the backlog, starts them with
// large batches and returns the time until every row of the backlog is
// published; with kill, it SIGKILLs every relay at once while they publish
// and restarts them.
func (in *injector) drainBacklog(ctx context.Context, tag string, kill bool, m map[string]float64) (time.Duration, error) {
	c := in.c
	for _, p := range c.relays {
		p.stop()
	}
	acked := in.burst(ctx, tag, chaos.MassKillBacklog, 16)
	if acked < chaos.MassKillBacklog/2 {
		return 0, fmt.Errorf("backlog: only %d of %d orders acknowledged", acked, chaos.MassKillBacklog)
	}
	var last int64
	if err := c.db.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM outbox`).Scan(&last); err != nil {
		return 0, fmt.Errorf("backlog: %w", err)
	}
	// pending is the backlog still unpublished, and how much of it a polling
	// relay has claimed (a claim counts an attempt; the backlog's rows
	// start with none). The WAL relay claims nothing in the table.
	pending := func() (int, int, error) {
		var n, claimed int
		err := c.db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE attempts > 0) FROM outbox
			WHERE id <= $1 AND dead_lettered_at IS NULL`, last).Scan(&n, &claimed)
		return n, claimed, err
	}
	backlog, _, err := pending()
	if err != nil {
		return 0, fmt.Errorf("backlog: %w", err)
	}
	batch := "RELAY_BATCH_SIZE=" + strconv.Itoa(massKillBatch)
	startAll := func() error {
		var errs []error
		for _, p := range c.relays {
			if _, err := p.start(batch); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	start := time.Now()
	if err := startAll(); err != nil {
		return 0, err
	}
	if kill {
		m[chaos.MeasureBacklog] = float64(backlog)
		// As soon as the polling relays claimed a large batch, or any relay
		// published: the rest of the backlog is in their batches or on its
		// way into them.
		var n, claimed int
		for deadline := time.Now().Add(2 * time.Minute); ; {
			if n, claimed, err = pending(); err != nil {
				return 0, err
			}
			if n < backlog || claimed >= massKillBatch || time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		var wg sync.WaitGroup
		for _, p := range c.relays {
			wg.Go(func() { p.kill() })
		}
		wg.Wait()
		m[chaos.MeasureInFlightAtKill], m[chaos.MeasureClaimedAtKill] = float64(n), float64(claimed)
		if err := startAll(); err != nil {
			return 0, err
		}
	} else {
		m[chaos.MeasureCleanBacklog] = float64(backlog)
	}
	restart := time.Now()
	for deadline := time.Now().Add(5 * time.Minute); ; {
		n, _, err := pending()
		if err != nil {
			return 0, err
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("backlog: %d of %d rows still unpublished after 5 minutes", n, backlog)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if kill {
		m[chaos.MeasureRestartToDrain] = time.Since(restart).Seconds()
	}
	return time.Since(start), nil
}

package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// schema4Path is the outbox schema as its version 4 wrote it, which
// migration_under_load upgrades (relative to the e2e package directory, go
// test's working directory).
var schema4Path = filepath.Join("..", "pkg", "outbox", "testdata", "schema4.sql")

// migrationUnderLoad runs `orders migrate` on the run's database (up to
// date: it must change nothing and block nobody) while the load, the relays
// and the scrapes go on; then a real upgrade: a second database of the same
// server gets outbox schema 4 and a writer that keeps a
// transaction open on the outbox table, and `orders migrate` upgrades it
// beside that writer. The services' binaries refuse a schema older than
// theirs, which is why the upgrade is not on the run's own database. The
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

	schema4, err := os.ReadFile(schema4Path)
	if err != nil {
		return fmt.Errorf("previous outbox schema: %w", err)
	}
	dbName := c.id + "_schema4"
	admin, err := pgx.Connect(ctx, c.adminURL)
	if err != nil {
		return fmt.Errorf("create %s: %w", dbName, err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{dbName}.Sanitize()); err != nil {
		return fmt.Errorf("create %s: %w", dbName, err)
	}
	defer func() {
		_, _ = admin.Exec(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+pgx.Identifier{dbName}.Sanitize()+" WITH (FORCE)")
	}()
	url := replaceDatabase(c.dbURL, dbName)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, string(schema4)); err != nil {
		return fmt.Errorf("load the previous outbox schema: %w", err)
	}

	// The writer of the previous version: a transaction at a time on the
	// outbox table, each held open a while, until the upgrade is over.
	writerCtx, stopWriter := context.WithCancel(ctx)
	var (
		wg       sync.WaitGroup
		written  int
		writeErr error
	)
	wg.Go(func() {
		for i := 1; writerCtx.Err() == nil; i++ {
			err := pgx.BeginFunc(writerCtx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(writerCtx, `INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
					VALUES ('order', $1, 1, 'order.created', '{}')`, "schema4-"+strconv.Itoa(i))
				sleep(writerCtx, 200*time.Millisecond)
				return err
			})
			switch {
			case err == nil:
				written++
			case writerCtx.Err() == nil:
				writeErr = fmt.Errorf("writer on the previous schema: %w", err)
				return
			}
			sleep(writerCtx, 20*time.Millisecond)
		}
	})
	time.Sleep(300 * time.Millisecond) // the writer holds its first transaction
	t1 := time.Now()
	out, err := c.run(ctx, c.orders.spec.bin, append(env[:len(env):len(env)], "DATABASE_URL="+url), "migrate")
	upgrade := time.Since(t1)
	stopWriter()
	wg.Wait()
	if err != nil {
		return fmt.Errorf("orders migrate (upgrade from schema 4): %w\n%s", err, out)
	}
	if writeErr != nil {
		return writeErr
	}
	var rows int
	var handedOver bool
	err = pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox),
		EXISTS (SELECT FROM information_schema.columns WHERE table_name = 'outbox' AND column_name = 'handed_over')`).Scan(&rows, &handedOver)
	switch {
	case err != nil:
		return fmt.Errorf("read the upgraded outbox: %w", err)
	case !handedOver:
		return errors.New("orders migrate did not upgrade the outbox from schema 4 (no handed_over column)")
	case rows != written:
		return fmt.Errorf("upgraded outbox holds %d rows, the writer committed %d", rows, written)
	}
	f.Measures = map[string]float64{
		chaos.MeasureMigrateSeconds: upToDate.Seconds(), chaos.MeasureUpgradeSeconds: upgrade.Seconds(),
		"schema4_writer_commits": float64(written),
	}
	record(fmt.Sprintf("orders migrate: up to date in %.1fs; upgrade from schema 4 beside a writer (%d commits) in %.1fs",
		upToDate.Seconds(), written, upgrade.Seconds()))
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

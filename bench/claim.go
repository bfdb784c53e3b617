package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// tableStats are the physical facts behind a claim latency.
type tableStats struct {
	OutboxLive      int64 `json:"outbox_live_tuples"`
	OutboxDead      int64 `json:"outbox_dead_tuples"`
	OutboxBytes     int64 `json:"outbox_heap_bytes"`
	DueIndexBytes   int64 `json:"outbox_due_index_bytes"`
	Published       int64 `json:"outbox_published_rows"`
	PublishedBytes  int64 `json:"outbox_published_bytes"`
	Aggregates      int64 `json:"outbox_aggregates_rows"`
	OutboxVacuumed  bool  `json:"outbox_ever_vacuumed"`
	OutboxAnalyzed  bool  `json:"outbox_ever_analyzed"`
	OutboxDeletes   int64 `json:"outbox_deleted_tuples_total"`
	OutboxUpdates   int64 `json:"outbox_updated_tuples_total"`
	OutboxIdxScans  int64 `json:"outbox_index_scans"`
	OutboxSeqScans  int64 `json:"outbox_seq_scans"`
	OutboxHOTUpdate int64 `json:"outbox_hot_updates"`
}

func readTableStats(ctx context.Context, pool *pgxpool.Pool) (tableStats, error) {
	var s tableStats
	// The statistics collector reports with a delay; give it its moment.
	_, _ = pool.Exec(ctx, "SELECT pg_stat_clear_snapshot()")
	err := pool.QueryRow(ctx, `
SELECT n_live_tup, n_dead_tup, pg_relation_size('outbox'), pg_relation_size('outbox_due'),
       (SELECT count(*) FROM outbox_published), pg_total_relation_size('outbox_published'),
       (SELECT count(*) FROM outbox_aggregates),
       coalesce(last_vacuum, last_autovacuum) IS NOT NULL, coalesce(last_analyze, last_autoanalyze) IS NOT NULL,
       n_tup_del, n_tup_upd, coalesce(idx_scan, 0), seq_scan, n_tup_hot_upd
FROM pg_stat_user_tables WHERE relname = 'outbox'`).Scan(
		&s.OutboxLive, &s.OutboxDead, &s.OutboxBytes, &s.DueIndexBytes, &s.Published, &s.PublishedBytes,
		&s.Aggregates, &s.OutboxVacuumed, &s.OutboxAnalyzed, &s.OutboxDeletes, &s.OutboxUpdates,
		&s.OutboxIdxScans, &s.OutboxSeqScans, &s.OutboxHOTUpdate)
	if err != nil {
		return s, fmt.Errorf("read table statistics: %w", err)
	}
	return s, nil
}

// claimSample is the claim latencies of one measurement.
type claimSample struct {
	all, nonEmpty, empty []time.Duration
	enqueued             int
	// plan is EXPLAIN (ANALYZE, BUFFERS) of the claim on the drained table,
	// run in a transaction rolled back.
	plan []string
}

// measureClaims runs the real relay, with in-process wake-ups, while one order
// event per transaction is enqueued at b.cfg.claimRate per second for
// b.cfg.claimMeasure, and returns the latency of every claim it ran.
//
// vacuumEvery is the relay's RelayConfig.VacuumEvery. With 0 (auto, the
// service's default) on a server without autovacuum the relay vacuums the
// outbox at start: the measurement then waits for that first vacuum.
func (b *bench) measureClaims(ctx context.Context, poolCfg *pgxpool.Config, pool *pgxpool.Pool, url string, vacuumEvery int) (claimSample, error) {
	timer := newSQLTimer()
	vacuumsBefore, err := manualVacuums(ctx, pool)
	if err != nil {
		return claimSample{}, err
	}
	cfg := b.relayConfig()
	cfg.VacuumEvery = vacuumEvery
	relay, err := startRelay(ctx, poolCfg, url, cfg, timer)
	if err != nil {
		return claimSample{}, err
	}
	defer relay.stop()
	if vacuumEvery == 0 {
		var autovacuum bool
		if err := pool.QueryRow(ctx, `SELECT current_setting('autovacuum')::bool`).Scan(&autovacuum); err != nil {
			return claimSample{}, err
		}
		for !autovacuum {
			n, err := manualVacuums(ctx, pool)
			if err != nil {
				return claimSample{}, err
			}
			if n > vacuumsBefore {
				break
			}
			select {
			case <-ctx.Done():
				return claimSample{}, ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	if err := waitDrained(ctx, pool, time.Minute); err != nil {
		return claimSample{}, err
	}

	// Warm up: connections opened, statements prepared, caches filled.
	if _, err := paced(ctx, b.cfg.claimRate, time.Second, 32, func(ctx context.Context, i int) error {
		return enqueueOrders(ctx, pool, 1, relay.relay.Wake)
	}); err != nil {
		return claimSample{}, fmt.Errorf("warm up: %w", err)
	}
	if err := waitDrained(ctx, pool, time.Minute); err != nil {
		return claimSample{}, err
	}

	timer.start()
	n, err := paced(ctx, b.cfg.claimRate, b.cfg.claimMeasure, 32, func(ctx context.Context, i int) error {
		return enqueueOrders(ctx, pool, 1, relay.relay.Wake)
	})
	if err != nil {
		return claimSample{}, fmt.Errorf("enqueue: %w", err)
	}
	if err := waitDrained(ctx, pool, time.Minute); err != nil {
		return claimSample{}, err
	}
	rec := timer.stop()
	s := claimSample{nonEmpty: rec["claim"], empty: rec["claim_empty"], enqueued: n}
	s.all = append(append(s.all, s.nonEmpty...), s.empty...)
	sql, args := timer.claimStatement()
	if len(s.all) == 0 || sql == "" {
		return s, errors.New("no claim statement observed: outbox.StatementOf named none of the relay's queries a claim")
	}
	if s.plan, err = explain(ctx, pool, sql, args); err != nil {
		return s, err
	}
	return s, nil
}

// manualVacuums is how many VACUUMs not run by autovacuum the outbox table had.
func manualVacuums(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("read outbox vacuum_count: %w", err)
	}
	return n, nil
}

// explain runs EXPLAIN (ANALYZE, BUFFERS) of sql in a transaction it rolls
// back, and returns the plan's lines.
func explain(ctx context.Context, pool *pgxpool.Pool, sql string, args []any) ([]string, error) {
	var plan []string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "+sql, args...)
		if err != nil {
			return err
		}
		plan, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		return errRollback
	})
	if err != nil && !errors.Is(err, errRollback) {
		return nil, fmt.Errorf("explain the claim: %w", err)
	}
	return plan, nil
}

var errRollback = errors.New("rollback")

// enqueueOrders writes n order.created events in one transaction through
// Enqueue, then wakes the relay, as the orders service does after a commit.
func enqueueOrders(ctx context.Context, pool *pgxpool.Pool, n int, wake func()) error {
	msgs := make([]outbox.Message, n)
	now := time.Now()
	for i := range msgs {
		id := newUUID()
		msgs[i] = outbox.Message{AggregateType: aggregateType, AggregateID: id, EventType: eventCreated,
			Payload: createdEvent(id, i, now), Headers: traceHeaders()}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, msgs...)
	})
	if err != nil {
		return err
	}
	wake()
	return nil
}

// cancelPayload is an order.cancelled body.
func cancelPayload(orderID string, at time.Time) []byte {
	return fmt.Appendf(nil, `{"order_id": %q, "cancelled_at": %q}`, orderID, at.UTC().Format(time.RFC3339Nano))
}

// churn pushes total events through the real path while the relay runs:
// writers enqueue orders in transactions of 100 events (80 order.created of
// new orders and 20 order.cancelled of orders created in the writer's
// previous transaction, so some events wait behind their aggregate's earlier
// one), the relay claims, publishes and moves them, and its retention purge
// deletes old published rows.
func (b *bench) churn(ctx context.Context, pool *pgxpool.Pool, relay *runningRelay, total int) error {
	const writers, perTx, cancels = 4, 100, 20
	var written atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for w := range writers {
		wg.Go(func() {
			var previous []string
			for written.Load() < int64(total) && ctx.Err() == nil {
				now := time.Now()
				msgs := make([]outbox.Message, 0, perTx)
				created := make([]string, 0, perTx-cancels)
				for i := range perTx - cancels {
					id := newUUID()
					created = append(created, id)
					msgs = append(msgs, outbox.Message{AggregateType: aggregateType, AggregateID: id, EventType: eventCreated,
						Payload: createdEvent(id, i, now), Headers: traceHeaders()})
				}
				for i := 0; i < cancels && i < len(previous); i++ {
					msgs = append(msgs, outbox.Message{AggregateType: aggregateType, AggregateID: previous[i], EventType: "order.cancelled",
						Payload: cancelPayload(previous[i], now), Headers: traceHeaders()})
				}
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					return outbox.Enqueue(ctx, tx, msgs...)
				})
				if err != nil {
					errs[w] = err
					return
				}
				relay.relay.Wake()
				written.Add(int64(len(msgs)))
				previous = created
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return fmt.Errorf("churn writer: %w", err)
		}
	}
	return waitDrained(ctx, pool, 5*time.Minute)
}

// runClaimFlat measures claim_flat: the latency of the relay's claim on a
// table that went through heavy churn with a large retained history, against
// the same measurement on a fresh database.
//
// This server runs with autovacuum=off, and the churn leaves every moved row
// as dead tuples and dead index entries in outbox. The aged table is measured
// three times: as the churn left it, never vacuumed (this server with the
// relay's own vacuum off); with the relay as the service runs it, which
// vacuums the outbox itself when autovacuum is off; and with a stand-in for
// autovacuum that applies the schema's own thresholds every second (what a
// server with autovacuum on does, with a short naptime). The fresh baseline
// runs with the same stand-in.
func (b *bench) runClaimFlat(ctx context.Context) ([]Figure, error) {
	url, err := b.env.newVhost(ctx, "claim")
	if err != nil {
		return nil, err
	}
	if err := declareDrainTopology(url, b.cfg.queueType); err != nil {
		return nil, err
	}
	const naptime = time.Second
	details := map[string]any{"claim_rate_per_s": b.cfg.claimRate, "measure_seconds": b.cfg.claimMeasure.Seconds(),
		"autovacuum_stand_in_naptime_s": naptime.Seconds()}

	// Fresh: a new database, nothing but the measurement's own rows.
	freshCfg, fresh, err := b.env.openDatabase(ctx, "claim_fresh", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer fresh.Close()
	av := startAutovacuum(ctx, fresh, naptime, b.quiet)
	freshSample, err := b.measureClaims(ctx, freshCfg, fresh, url, -1)
	freshAV, avErr := av.stop()
	if err != nil {
		return nil, fmt.Errorf("fresh: %w", err)
	}
	if avErr != nil {
		return nil, avErr
	}
	if _, err := takeQueue(url, drainQueueName); err != nil {
		return nil, err
	}
	freshStats, err := readTableStats(ctx, fresh)
	if err != nil {
		return nil, err
	}

	// Aged: a large history written set-based, then churn through the real
	// path (enqueue, claim, publish, move, purge), then the same measurement.
	agedCfg, aged, err := b.env.openDatabase(ctx, "claim_aged", migrateOutbox)
	if err != nil {
		return nil, err
	}
	defer aged.Close()
	start := time.Now()
	retained := b.cfg.claimRetained
	if err := (seedDirect{aged}).publishedOrders(ctx, retained); err != nil {
		return nil, err
	}
	b.log.Info("claim_flat history written", "rows", retained, "seconds", int(time.Since(start).Seconds()))

	start = time.Now()
	churnCfg := b.relayConfig()
	churnCfg.PublishedRetention = 7 * 24 * time.Hour
	churnCfg.PurgeInterval = 5 * time.Second
	churnCfg.VacuumEvery = -1 // leave what the churn leaves, as a server without autovacuum would
	relay, err := startRelay(ctx, agedCfg, url, churnCfg, nil)
	if err != nil {
		return nil, err
	}
	err = b.churn(ctx, aged, relay, b.cfg.claimChurn)
	relay.stop()
	if err != nil {
		return nil, err
	}
	if _, err := takeQueue(url, drainQueueName); err != nil {
		return nil, err
	}
	purged, err := outboxadmin.New(aged).Purge(ctx, 7*24*time.Hour, 1000)
	if err != nil {
		return nil, err
	}
	b.log.Info("claim_flat churn done", "events", b.cfg.claimChurn, "seconds", int(time.Since(start).Seconds()), "purged_after", purged)
	churnStats, err := readTableStats(ctx, aged)
	if err != nil {
		return nil, err
	}

	// As the churn left it: never vacuumed.
	noVacuumSample, err := b.measureClaims(ctx, agedCfg, aged, url, -1)
	if err != nil {
		return nil, fmt.Errorf("aged, no vacuum: %w", err)
	}
	noVacuumStats, err := readTableStats(ctx, aged)
	if err != nil {
		return nil, err
	}
	if _, err := takeQueue(url, drainQueueName); err != nil {
		return nil, err
	}

	// The relay as the service runs it (VacuumEvery auto): on this server,
	// without autovacuum, it vacuums the outbox itself at start (what the
	// churn left) and then every 5,000 rows it moves.
	start = time.Now()
	relayVacuumSample, err := b.measureClaims(ctx, agedCfg, aged, url, 0)
	if err != nil {
		return nil, fmt.Errorf("aged, relay's vacuum: %w", err)
	}
	details["relay_vacuum_measure_seconds"] = round(time.Since(start).Seconds())
	relayVacuumStats, err := readTableStats(ctx, aged)
	if err != nil {
		return nil, err
	}

	// With the autovacuum stand-in: a first pass, unthrottled and before the
	// measurement, vacuums what the churn left (as autovacuum would have done
	// during it); then the stand-in keeps up during the measurement.
	start = time.Now()
	catchUp := &autovacuum{vacuums: map[string]int{}, analyzes: map[string]int{}}
	if err := catchUp.pass(ctx, aged, false); err != nil {
		return nil, fmt.Errorf("vacuum after the churn: %w", err)
	}
	details["catch_up_vacuum_seconds"] = round(time.Since(start).Seconds())
	details["catch_up_vacuum"] = map[string]any{"vacuums": catchUp.vacuums, "analyzes": catchUp.analyzes}
	av = startAutovacuum(ctx, aged, naptime, b.quiet)
	agedSample, err := b.measureClaims(ctx, agedCfg, aged, url, -1)
	agedAV, avErr := av.stop()
	if err != nil {
		return nil, fmt.Errorf("aged: %w", err)
	}
	if avErr != nil {
		return nil, avErr
	}
	if _, err := takeQueue(url, drainQueueName); err != nil {
		return nil, err
	}
	agedStats, err := readTableStats(ctx, aged)
	if err != nil {
		return nil, err
	}

	sums := map[string]Latencies{}
	for name, s := range map[string]claimSample{"fresh": freshSample, "aged": agedSample, "aged_no_vacuum": noVacuumSample, "aged_relay_vacuum": relayVacuumSample} {
		all, err := summarize(s.all)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		sums[name] = all
		d := map[string]any{"claims": all.N, "events": s.enqueued,
			"all_p50_ms": ms(all.P50), "all_p99_ms": ms(all.P99)}
		if ne, err := summarize(s.nonEmpty); err == nil {
			d["non_empty_claims"], d["non_empty_p50_ms"], d["non_empty_p99_ms"] = ne.N, ms(ne.P50), ms(ne.P99)
		}
		if e, err := summarize(s.empty); err == nil {
			d["empty_claims"], d["empty_p50_ms"], d["empty_p99_ms"] = e.N, ms(e.P50), ms(e.P99)
		}
		d["empty_claim_plan"] = s.plan
		details[name] = d
	}
	details["fresh_autovacuum_stand_in"] = freshAV
	details["aged_autovacuum_stand_in"] = agedAV
	details["fresh_tables"] = freshStats
	details["aged_tables_after_churn"] = churnStats
	details["aged_tables_after_no_vacuum_measure"] = noVacuumStats
	details["aged_tables_after_relay_vacuum_measure"] = relayVacuumStats
	details["aged_tables_after_measure"] = agedStats
	details["history_rows"] = retained
	details["churn_events"] = b.cfg.claimChurn
	details["purged_rows_total"] = int64(retained+b.cfg.claimChurn) - churnStats.Published

	f, a, nv, rv := sums["fresh"], sums["aged"], sums["aged_no_vacuum"], sums["aged_relay_vacuum"]
	what := fmt.Sprintf("claim statement latency (the relay's own SQL, timed by a pgx tracer on the relay's pool) while %d events/s are enqueued with in-process wake-ups, on a table after %d events of churn (enqueue, claim, publish, move, retention purge) with %d published rows retained",
		b.cfg.claimRate, b.cfg.claimChurn, churnStats.Published)
	withAV := ", autovacuum stand-in at the schema's thresholds, the relay's own vacuum off"
	noAV := ", never vacuumed (autovacuum=off on this server, the relay's own vacuum off)"
	relayV := ", autovacuum=off on this server, the relay as the service runs it (VacuumEvery auto: it vacuums the outbox at start and every 5,000 rows moved)"
	baseIs := "the same measurement on a fresh database, autovacuum stand-in on"
	return []Figure{
		newFigure("claim_flat_p50", "ms", ms(a.P50), ms(f.P50), Goal{RatioAtMost, 2}, "p50 "+what+withAV, baseIs, details),
		newFigure("claim_flat_p99", "ms", ms(a.P99), ms(f.P99), Goal{RatioAtMost, 2}, "p99 "+what+withAV, baseIs, nil),
		newFigure("claim_flat_relay_vacuum_p50", "ms", ms(rv.P50), ms(f.P50), Goal{RatioAtMost, 2}, "p50 "+what+relayV, baseIs, nil),
		newFigure("claim_flat_relay_vacuum_p99", "ms", ms(rv.P99), ms(f.P99), Goal{RatioAtMost, 2}, "p99 "+what+relayV, baseIs, nil),
		newFigure("claim_flat_no_vacuum_p50", "ms", ms(nv.P50), ms(f.P50), Goal{RatioAtMost, 2}, "p50 "+what+noAV, baseIs, nil),
		newFigure("claim_flat_no_vacuum_p99", "ms", ms(nv.P99), ms(f.P99), Goal{RatioAtMost, 2}, "p99 "+what+noAV, baseIs, nil),
	}, nil
}

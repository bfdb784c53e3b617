package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// statusBacklog is the backlog status_scrape reads: the outbox of a long
// broker outage.
const statusBacklog = 1_000_000

// statusCalls is how many Status calls each arm of status_scrape times.
const statusCalls = 300

// oldStatusSQL is what Admin.Status ran before its cost was bounded: a scan of
// the whole outbox. Timed for the record.
const oldStatusSQL = `
SELECT count(*) FILTER (WHERE dead_lettered_at IS NULL),
       count(*) FILTER (WHERE dead_lettered_at IS NOT NULL),
       min(created_at) FILTER (WHERE dead_lettered_at IS NULL)
FROM outbox`

// statusArm is one outbox status_scrape reads: a database of its own.
type statusArm struct {
	name    string
	backlog int
	pool    *pgxpool.Pool
	admin   *outboxadmin.Admin
	samples []time.Duration
	last    outboxadmin.Status
}

// runStatusScrape measures status_scrape: the latency of Admin.Status, which
// every API and relay process runs on each metrics scrape, with a backlog of
// statusBacklog rows against an empty outbox; and, for the record, with a
// backlog of StatusCountLimit rows, the costliest one Status still counts
// exactly. One client, sequential calls; the arms alternate in blocks of 10
// so background noise lands on all of them alike.
func (b *bench) runStatusScrape(ctx context.Context) ([]Figure, error) {
	arms := []*statusArm{
		{name: "empty"},
		{name: "at_count_limit", backlog: outboxadmin.StatusCountLimit},
		{name: "large", backlog: statusBacklog},
	}
	for _, a := range arms {
		_, pool, err := b.env.openDatabase(ctx, "status_"+a.name, migrateOutbox)
		if err != nil {
			return nil, err
		}
		defer pool.Close()
		a.pool, a.admin = pool, outboxadmin.New(pool)
		if a.backlog == 0 {
			continue
		}
		start := time.Now()
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return nil, err
		}
		err = (seedDirect{conn}).pendingRows(ctx, a.backlog)
		if err == nil {
			// Make the statistics count the insert now, as they do within a
			// second or so on their own.
			_, err = conn.Exec(ctx, "SELECT pg_stat_force_next_flush()")
		}
		conn.Release()
		if err != nil {
			return nil, fmt.Errorf("fill the %s backlog: %w", a.name, err)
		}
		b.log.Info("status_scrape backlog filled", "rows", a.backlog, "seconds", int(time.Since(start).Seconds()))
	}

	call := func(a *statusArm) (time.Duration, error) {
		start := time.Now()
		st, err := a.admin.Status(ctx)
		if err != nil {
			return 0, fmt.Errorf("%s: status: %w", a.name, err)
		}
		a.last = st
		return time.Since(start), nil
	}
	for _, a := range arms { // warm up: connections, prepared statements, caches
		for range 20 {
			if _, err := call(a); err != nil {
				return nil, err
			}
		}
	}
	const block = 10
	for range statusCalls / block {
		for _, a := range arms {
			for range block {
				d, err := call(a)
				if err != nil {
					return nil, err
				}
				a.samples = append(a.samples, d)
			}
		}
	}
	details := map[string]any{"backlog_rows": statusBacklog, "count_limit": outboxadmin.StatusCountLimit}
	sums := map[string]Latencies{}
	for _, a := range arms {
		l, err := summarize(a.samples)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		sums[a.name] = l
		details[a.name] = l
		details["status_"+a.name] = map[string]any{"pending": a.last.Pending, "pending_estimated": a.last.PendingEstimated,
			"dead_lettered": a.last.DeadLettered, "oldest_pending_age_s": round(a.last.OldestPendingAge.Seconds())}
	}
	details["at_count_limit_p50_ms"] = round(ms(sums["at_count_limit"].P50))

	// What the unbounded query of earlier versions costs on the same backlog.
	large := arms[2]
	var old []time.Duration
	for range 3 {
		start := time.Now()
		if _, err := large.pool.Exec(ctx, oldStatusSQL); err != nil {
			return nil, fmt.Errorf("full scan: %w", err)
		}
		old = append(old, time.Since(start))
	}
	oldSum, err := summarize(old)
	if err != nil {
		return nil, err
	}
	details["full_scan_p50_ms"] = round(ms(oldSum.P50))
	if details["table"], err = readTableStats(ctx, large.pool); err != nil {
		return nil, err
	}

	return []Figure{newFigure("status_scrape", "ms", ms(sums["large"].P50), ms(sums["empty"].P50),
		Goal{Kind: RatioAtMost, Limit: 2},
		fmt.Sprintf("p50 of outboxadmin.Admin.Status (what every orders process runs on each /metrics scrape), %d sequential calls, with a backlog of %d pending rows", statusCalls, statusBacklog),
		"the same calls on an empty outbox, alternating with them",
		details)}, nil
}

package chaos

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Faults of the infrastructure around the services: the database server
// fails over or stalls on its synchronous standby, the schema is migrated
// under load, every relay dies at once with a large backlog in flight. The
// suite injects them on the run's own PostgreSQL (the first two need it).
const (
	// A streaming standby of the run's own PostgreSQL (pg_basebackup,
	// asynchronous) is promoted after the primary is stopped immediately,
	// and the proxy the services reach the database through is switched to
	// it. The last commits the API acknowledged may be missing on the new
	// primary: the checker counts them as lost by the database failover.
	FaultPostgresFailover FaultKind = "postgres_failover"
	// synchronous_standby_names names a fresh standby, which is then
	// stopped: every commit waits, its transaction invisible to other
	// sessions. While it waits, no event of a commit still waiting may reach
	// shipping (an effect whose order version shows only once the wait ends
	// is counted as a phantom). Then the standby starts again and catches
	// up, and the setting and the standby go.
	FaultPostgresSyncStall FaultKind = "postgres_sync_stall"
	// `orders migrate` on the run's database (up to date), then that of the
	// next release (one more outbox schema version) on the same database
	// beside an open reader, while the load, the relays and the status
	// scrapes run.
	FaultMigrationUnderLoad FaultKind = "migration_under_load"
	// Every relay stopped, a backlog of MassKillBacklog orders created, the
	// relays started with large batches and SIGKILLed all at once while
	// they publish it, then restarted; the same backlog is then drained
	// cleanly, for the comparison.
	FaultRelayMassKill FaultKind = "relay_mass_kill"
)

// InfraFaultKinds are the infrastructure faults, in a stable order.
var InfraFaultKinds = []FaultKind{FaultPostgresFailover, FaultPostgresSyncStall, FaultMigrationUnderLoad, FaultRelayMassKill}

// OwnPostgresFaultKinds need a PostgreSQL server of the run's own.
var OwnPostgresFaultKinds = []FaultKind{FaultPostgresRestart, FaultPostgresFailover, FaultPostgresSyncStall}

// MassKillBacklog is the number of orders a relay_mass_kill creates while the
// relays are stopped. The relays die as soon as polling relays claimed a
// batch of 1,000, or any relay published: with the WAL relay, after its first
// sweep (a few hundred rows in trial runs), more than 1,000 rows are in
// flight.
const MassKillBacklog = 1500

// Keys of Fault.Measures.
const (
	// relay_mass_kill
	MeasureBacklog              = "backlog_rows"          // outbox rows pending when the relays started
	MeasureInFlightAtKill       = "pending_at_kill"       // backlog rows still unpublished at the SIGKILL, the relays publishing
	MeasureClaimedAtKill        = "claimed_at_kill"       // of those, rows a polling relay had claimed
	MeasureDrainAfterKill       = "drain_after_kill_s"    // from the relays' start to an empty outbox, across the kill
	MeasureDrainClean           = "drain_clean_s"         // the same backlog, no kill
	MeasureRestartToDrain       = "drain_after_restart_s" // from the restart after the kill to an empty outbox
	MeasureCleanBacklog         = "clean_backlog_rows"    // outbox rows pending when the clean drain started
	MeasurePhantomEffects       = "phantom_effects"       // postgres_sync_stall: effects seen while their order was invisible
	MeasureMigrateSeconds       = "migrate_up_to_date_s"  // migration_under_load
	MeasureNextMigrationSeconds = "next_migration_s"      // migration_under_load
)

// FaultMeasure is what the report says about one infrastructure fault, pause
// or PostgreSQL path fault besides its count: the measures the injector took,
// and for a migration the API's latency while it ran.
type FaultMeasure struct {
	Kind     FaultKind          `json:"kind"`
	Start    time.Time          `json:"start"`
	Seconds  float64            `json:"seconds"`
	Measures map[string]float64 `json:"measures,omitempty"`
	// APIOps, APIP99Ms: operations that started while the fault lasted, and
	// the 99th percentile of their latency (retries included).
	APIOps   int     `json:"api_ops,omitempty"`
	APIP99Ms float64 `json:"api_p99_ms,omitempty"`
	// APIP99MsCalmMs is the same percentile over operations that overlapped
	// no fault, for comparison.
	APIP99CalmMs float64 `json:"api_p99_calm_ms,omitempty"`
}

// faultMeasures lists the infrastructure faults of h with their measures.
func faultMeasures(h History) []FaultMeasure {
	var calm []time.Duration
	for _, op := range h.Ops {
		overlaps := slices.ContainsFunc(h.Faults, func(f Fault) bool { return !op.End.Before(f.Start) && !op.Start.After(f.End) })
		if !overlaps {
			calm = append(calm, op.End.Sub(op.Start))
		}
	}
	calmP99 := p99(calm)
	var out []FaultMeasure
	for _, f := range h.Faults {
		if !slices.Contains(InfraFaultKinds, f.Kind) && !slices.Contains(PauseAndPathFaultKinds, f.Kind) && !resourceFault(f.Kind) {
			continue
		}
		m := FaultMeasure{Kind: f.Kind, Start: f.Start, Seconds: f.End.Sub(f.Start).Seconds(), Measures: f.Measures}
		if f.Kind == FaultMigrationUnderLoad {
			var during []time.Duration
			for _, op := range h.Ops {
				if !op.Start.Before(f.Start) && !op.Start.After(f.End) {
					during = append(during, op.End.Sub(op.Start))
				}
			}
			m.APIOps, m.APIP99Ms, m.APIP99CalmMs = len(during), ms(p99(during)), ms(calmP99)
		}
		out = append(out, m)
	}
	slices.SortStableFunc(out, func(a, b FaultMeasure) int { return a.Start.Compare(b.Start) })
	return out
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// p99 is the 99th percentile (nearest rank) of ds, 0 when empty.
func p99(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	ds = slices.Clone(ds)
	slices.Sort(ds)
	i := (len(ds)*99+99)/100 - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

// Burst creates n orders, concurrency at a time, as fast as the API answers,
// recording each operation as Run does; keys are KeyPrefix-tag-i. It returns
// how many were acknowledged. Nothing is cancelled.
func (w *Workload) Burst(ctx context.Context, tag string, n, concurrency int) int {
	var (
		next, acked atomic.Int64
		wg          sync.WaitGroup
	)
	for c := range cmp.Or(concurrency, 1) {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w.cfg.Seed), uint64(1000+c)))
			for {
				i := next.Add(1)
				if i > int64(n) || ctx.Err() != nil {
					return
				}
				if op := w.create(context.WithoutCancel(ctx), fmt.Sprintf("%s-%s-%d", w.cfg.KeyPrefix, tag, i), rng); op.Outcome == OutcomeOK {
					acked.Add(1)
				}
			}
		})
	}
	wg.Wait()
	return int(acked.Load())
}

// infraFaults turns what an infrastructure fault saw into violations: an
// effect in shipping while its order's commit was still waiting for the
// synchronous standby is a phantom (I2), whatever the end state shows.
func (c *checker) infraFaults(h History) {
	for _, f := range h.Faults {
		if n := f.Measures[MeasurePhantomEffects]; f.Kind == FaultPostgresSyncStall && n > 0 {
			c.r.UnknownEffects += int(n)
			c.violate(Violation{Invariant: "I2", Kind: "phantom_effect",
				Detail: fmt.Sprintf("%v effects reached shipping while their order's commit waited for the synchronous standby (%s)", n, f.Detail)})
		}
	}
}

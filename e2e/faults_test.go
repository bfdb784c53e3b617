package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// injector carries out a fault plan against a cluster and records each fault
// it injected. Faults on one resource (a process, a proxy, the broker, the
// database, MongoDB) never overlap; faults on different ones may.
type injector struct {
	c      *cluster
	rec    *chaos.Recorder
	poison *poisoner
	logf   func(format string, args ...any)

	// burst creates orders through the workload (relay_mass_kill's backlog).
	burst func(ctx context.Context, tag string, n, concurrency int) int

	mu    sync.Mutex
	locks map[string]*sync.Mutex

	disks dataDisks // the data directories the disk-full faults moved
}

func newInjector(c *cluster, rec *chaos.Recorder, poison *poisoner, logf func(string, ...any)) *injector {
	return &injector{c: c, rec: rec, poison: poison, logf: logf, locks: make(map[string]*sync.Mutex)}
}

func (in *injector) lock(resource string) func() {
	in.mu.Lock()
	m, ok := in.locks[resource]
	if !ok {
		m = new(sync.Mutex)
		in.locks[resource] = m
	}
	in.mu.Unlock()
	m.Lock()
	return m.Unlock
}

// resource is what a step disturbs, for serialising steps. A pause of a
// process locks the process, as its kill and its crash points do: a pause
// never overlaps a kill of the same process.
func resource(s chaos.Step) string {
	switch s.Kind {
	case chaos.FaultBrokerCloseConnections, chaos.FaultBrokerAppRestart,
		chaos.FaultNodeKill, chaos.FaultNodeKillLeader, chaos.FaultNodeAppRestart, chaos.FaultNodeProxyDown,
		chaos.FaultNodeMajorityDown, chaos.FaultNodeWipe, chaos.FaultNodePartition, chaos.FaultBrokerAlarm:
		// One node fault at a time: a majority stays up (but in the fault
		// that takes it away on purpose).
		return "broker"
	case chaos.FaultPostgresKillSessions, chaos.FaultPostgresRestart, chaos.FaultPostgresFailover, chaos.FaultPostgresSyncStall,
		chaos.FaultMigrationUnderLoad, // a migration needs the server up: a restart would fail it, not the system
		// A pause of the server or a fault on a proxy to it: one at a time,
		// and none during a failover, which points the proxies elsewhere.
		chaos.FaultPausePostgres, chaos.FaultPostgresProxyLatency, chaos.FaultPostgresProxyTimeout,
		chaos.FaultPostgresProxyResetPeer, chaos.FaultPostgresRelayCut:
		return "postgres"
	case chaos.FaultRelayMassKill:
		return string(s.Kind) // and it takes the relays and the database (relayMassKill)
	case chaos.FaultMongoRestart, chaos.FaultMongoProxyDown:
		return "mongo"
	}
	if _, ok := s.Kind.PoisonKind(); ok {
		return "poison"
	}
	if r := resourceOf(s.Kind); r != "" {
		return r
	}
	return s.Target
}

// resources is what step s locks, in the order every step takes them: its
// resource (with, for a broker alarm, what its check reads), or, for a
// crash point on a WAL relay, every relay (the step stops
// the others for its length, walHoldOtherRelays, and a kill of one of them
// must not start it again under the step); for a relay's pause, every relay
// too (with the WAL relay it pauses the slot's holder, whichever the plan
// drew; with the polling relay it stops the others for a moment to catch the
// target holding a lease; and its check needs another relay to take over).
func (in *injector) resources(s chaos.Step) []string {
	if s.Kind == chaos.FaultBrokerAlarm {
		// No proxy fault of either side while the alarm holds (shipping's
		// cut is the alarm's own, and an orders-side cut would burn
		// attempts that are not the alarm's), nor a fault of what its
		// check reads: the outbox's attempts in PostgreSQL and shipping's
		// applied events in MongoDB. No step takes any of these before
		// "broker", so the order makes no cycle.
		return []string{resource(s), chaos.TargetAMQPOrders, chaos.TargetAMQPShipping, "postgres", "mongo"}
	}
	if _, ok := s.Kind.CrashPoint(); ok && os.Getenv("CHAOS_RELAY_MODE") == "wal" || s.Kind == chaos.FaultPauseRelay {
		var names []string
		for _, p := range in.c.relays {
			names = append(names, p.spec.name)
		}
		if slices.Contains(names, s.Target) {
			return names // in the cluster's order, as relayMassKill takes them
		}
	}
	return []string{resource(s)}
}

// run carries out plan, each step at start+At, and returns when all are done
// (or ctx ended). Errors are logged and returned joined: a fault that could
// not be injected is a harness failure, not a system one.
func (in *injector) run(ctx context.Context, start time.Time, plan []chaos.Step) error {
	var wg sync.WaitGroup
	errs := make([]error, len(plan))
	for i, s := range plan {
		wg.Go(func() {
			t := time.NewTimer(time.Until(start.Add(s.At)))
			defer t.Stop()
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			for _, r := range in.resources(s) {
				defer in.lock(r)()
			}
			if ctx.Err() != nil {
				return
			}
			if err := in.inject(ctx, s); err != nil && ctx.Err() == nil {
				errs[i] = fmt.Errorf("%v: %w", s, err)
				in.logf("fault %v: %v", s, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// inject carries out one step, holding an outage for s.Hold, and records it.
func (in *injector) inject(ctx context.Context, s chaos.Step) error {
	f := chaos.Fault{Kind: s.Kind, Target: s.Target, Start: time.Now()}
	record := func(detail string) {
		f.End, f.Detail = time.Now(), detail
		in.rec.Fault(f)
		in.logf("fault %s%s %s (%.1fs)", s.Kind, onTarget(s.Target), detail, f.End.Sub(f.Start).Seconds())
	}
	if point, ok := s.Kind.CrashPoint(); ok {
		return in.crashPoint(ctx, s, point, &f, record)
	}
	if kind, ok := s.Kind.PoisonKind(); ok {
		p, err := in.poison.publish(ctx, kind)
		if err != nil {
			return err
		}
		in.rec.Poison(p)
		record("published " + p.ID)
		return nil
	}
	switch s.Kind {
	case chaos.FaultKillOrders, chaos.FaultKillRelay, chaos.FaultKillShipping:
		p, ok := in.c.procs[s.Target]
		if !ok {
			return fmt.Errorf("no process %q", s.Target)
		}
		inc := p.kill()
		if inc == nil {
			// Between a crash of its own and the supervisor's restart.
			if err := p.ensureRunning(); err != nil {
				return err
			}
			if inc = p.kill(); inc == nil {
				return fmt.Errorf("%s was not running", s.Target)
			}
		}
		sleep(ctx, s.Hold)
		if err := p.ensureRunning(); err != nil {
			return err
		}
		record(fmt.Sprintf("SIGKILL #%d, down %v", inc.n, s.Hold.Round(time.Millisecond)))
	case chaos.FaultBrokerProxyDown, chaos.FaultMongoProxyDown:
		names := []string{proxyMongo}
		if s.Kind == chaos.FaultBrokerProxyDown {
			names = in.c.proxies(s.Target)
		}
		if err := in.proxiesDown(ctx, names, s.Hold); err != nil {
			return err
		}
		record("proxy disabled")
	case chaos.FaultBrokerProxyResetPeer:
		return in.toxic(ctx, s, "reset_peer", map[string]any{"timeout": 0}, record)
	case chaos.FaultBrokerProxyLatency:
		return in.toxic(ctx, s, "latency", map[string]any{"latency": 400, "jitter": 200}, record)
	case chaos.FaultBrokerProxyTimeout:
		return in.toxic(ctx, s, "timeout", map[string]any{"timeout": 0}, record)
	case chaos.FaultBrokerCloseConnections:
		if err := in.c.rabbitmqctl(ctx, "close_all_connections", "--vhost", in.c.vhost, "chaos: broker_close_connections"); err != nil {
			return err
		}
		record("every connection of vhost " + in.c.vhost + " closed by the broker")
	case chaos.FaultBrokerAppRestart:
		return in.brokerAppRestart(ctx, s, record)
	case chaos.FaultNodeKill, chaos.FaultNodeKillLeader, chaos.FaultNodeAppRestart, chaos.FaultNodeProxyDown,
		chaos.FaultNodeMajorityDown, chaos.FaultNodeWipe, chaos.FaultNodePartition:
		return in.nodeFault(ctx, s, &f, record)
	case chaos.FaultBrokerAlarm:
		return in.brokerAlarm(ctx, s, record)
	case chaos.FaultPostgresKillSessions:
		n, err := in.killSessions(ctx)
		if err != nil {
			return err
		}
		record(strconv.Itoa(n) + " sessions terminated")
	case chaos.FaultPostgresRestart:
		if in.c.pg == nil {
			return errors.New("the run has no PostgreSQL cluster of its own to restart")
		}
		if in.c.pg.stopImmediately() == nil {
			return errors.New("own PostgreSQL was not running")
		}
		sleep(ctx, s.Hold)
		startCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
		defer cancel()
		if err := in.c.pg.start(startCtx); err != nil {
			return err
		}
		record("stopped immediately (SIGQUIT, like pg_ctl -m immediate), started again after crash recovery")
	case chaos.FaultMongoRestart:
		if err := in.c.mongo.stop(ctx); err != nil {
			return err
		}
		sleep(ctx, s.Hold)
		// Restart with a context of its own: a fault is always healed.
		startCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
		defer cancel()
		if err := in.c.mongo.start(startCtx); err != nil {
			return err
		}
		if err := in.c.toxi.setUpstream(proxyMongo, in.c.mongo.addr()); err != nil {
			return err
		}
		record("server killed and started again on the same data")
	case chaos.FaultPostgresFailover:
		return in.postgresFailover(ctx, s, &f, record)
	case chaos.FaultPostgresSyncStall:
		return in.postgresSyncStall(ctx, s, &f, record)
	case chaos.FaultMigrationUnderLoad:
		return in.migrationUnderLoad(ctx, &f, record)
	case chaos.FaultRelayMassKill:
		return in.relayMassKill(ctx, &f, record)
	case chaos.FaultPauseRelay, chaos.FaultPauseShipping, chaos.FaultPauseOrders, chaos.FaultPausePostgres:
		return in.pause(ctx, s, &f, record)
	case chaos.FaultPostgresProxyLatency, chaos.FaultPostgresProxyTimeout, chaos.FaultPostgresProxyResetPeer, chaos.FaultPostgresRelayCut:
		return in.postgresPath(ctx, s, &f, record)
	default:
		return in.resourceFault(ctx, s, &f, record)
	}
	return nil
}

func onTarget(target string) string {
	if target == "" {
		return ""
	}
	return " on " + target
}

// toxic adds a toxic to both directions of the target broker proxy (the
// side's proxy to every node on a cluster) for s.Hold.
func (in *injector) toxic(ctx context.Context, s chaos.Step, typ string, attrs map[string]any, record func(string)) error {
	return in.toxicOn(ctx, in.c.proxies(s.Target), s, typ, attrs, record)
}

// proxiesDown disables the proxies for hold, then enables them again.
func (in *injector) proxiesDown(ctx context.Context, names []string, hold time.Duration) error {
	var errs []error
	for _, name := range names {
		errs = append(errs, in.c.toxi.disable(name))
	}
	sleep(ctx, hold)
	for _, name := range names {
		errs = append(errs, in.c.toxi.enable(name))
	}
	return errors.Join(errs...)
}

// crashPoint restarts the target with CRASH_POINT armed and waits for it to
// die there; the supervisor then restarts it unarmed. A point not reached
// (reachClock: 45 s once the workload flows) is disarmed and reported, not
// recorded.
func (in *injector) crashPoint(ctx context.Context, s chaos.Step, point string, f *chaos.Fault, record func(string)) error {
	p, ok := in.c.procs[s.Target]
	if !ok {
		return fmt.Errorf("no process %q", s.Target)
	}
	var (
		inc *incarnation
		err error
	)
	for range 3 { // the supervisor may restart it between our stop and start
		p.stop()
		if inc, err = p.start("CRASH_POINT="+point, "CRASH_AFTER="+strconv.Itoa(s.CrashAfter)); err == nil {
			break
		}
	}
	if err != nil {
		return err
	}
	defer in.walHoldOtherRelays(s.Target)()
	f.Start = time.Now()
	clock := reachClock{armed: f.Start, need: s.CrashAfter, window: 45 * time.Second, limit: 3 * time.Minute}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	// The armed incarnation, or one restarted armed after it failed for
	// another reason (a dependency down at its start), fires.
	fired := func() *incarnation {
		for cur := inc; ; {
			select {
			case <-cur.fired:
				return cur
			case <-ctx.Done():
				return nil
			case now := <-tick.C:
				if clock.expired(now, in.rec.AcknowledgedSince(f.Start)) {
					return nil
				}
			case <-cur.done:
				if isDone(cur.fired) {
					return cur
				}
				// Died otherwise: follow the supervisor's armed restart.
				time.Sleep(50 * time.Millisecond)
				if next := p.current(); next != nil && next.point == point {
					cur = next
				} else if next != nil {
					return nil
				}
			}
		}
	}()
	if fired == nil {
		// Disarm: whatever happens, the process runs unarmed after this step.
		p.stop()
		if err := p.ensureRunning(); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("crash point %s not reached %d times on %s: %s", point, s.CrashAfter, s.Target, clock.describe(time.Now(), in.rec.AcknowledgedSince(f.Start)))
	}
	// The supervisor restarts it after its restart delay.
	deadline := time.Now().Add(30 * time.Second)
	for {
		if cur := p.current(); cur != nil && cur.n > fired.n {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not restarted after its crash point", s.Target)
		}
		time.Sleep(20 * time.Millisecond)
	}
	record(fmt.Sprintf("died at %s (CRASH_AFTER=%d), restarted", point, s.CrashAfter))
	return nil
}

// reachClock decides when an armed crash point that has not fired counts as
// not reached. Every crash point sits on the path of an event (the API's
// commit, the relay's publish, the consumer's effect), so the clock runs
// from the moment the workload had acknowledged need operations since the
// arming, each of which committed an event: while other faults hold the
// workload (the API paused or killed, the database full or restarting) the
// point cannot be reached, and that is no failure of the process armed.
// Past limit after the arming, it is not reached whatever the workload did.
type reachClock struct {
	armed         time.Time
	need          int
	window, limit time.Duration

	flowing time.Time // when the workload had acknowledged need operations
}

// expired tells whether the point, not fired at now with acked operations
// acknowledged since the arming, is not reached.
func (c *reachClock) expired(now time.Time, acked int) bool {
	if c.flowing.IsZero() && acked >= max(c.need, 1) {
		c.flowing = now
	}
	if now.Sub(c.armed) >= c.limit {
		return true
	}
	return !c.flowing.IsZero() && now.Sub(c.flowing) >= c.window
}

// describe says why the point counts as not reached, for the error.
func (c *reachClock) describe(now time.Time, acked int) string {
	if c.flowing.IsZero() {
		return fmt.Sprintf("the workload acknowledged %d operations in the %v since the arming", acked, now.Sub(c.armed).Round(time.Second))
	}
	return fmt.Sprintf("%v after the workload acknowledged %d operations since the arming (%d by now)", now.Sub(c.flowing).Round(time.Second), c.need, acked)
}

// brokerAppRestart stops the whole broker application and starts it again.
// The restoration is deferred and also in the cluster's cleanup.
func (in *injector) brokerAppRestart(ctx context.Context, s chaos.Step, record func(string)) error {
	c := in.c
	if c.rabbit != nil {
		return in.ownBrokerAppRestart(ctx, s, record)
	}
	// An interrupt (Ctrl-C, go test's own signal) would end the test binary
	// without any cleanup while the broker is down: while it is, the signal
	// starts the broker app first, then exits.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	restored := make(chan struct{})
	var watcher sync.WaitGroup
	watcher.Go(func() {
		select {
		case sig := <-sigs:
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			c.restoreBroker(ctx)
			fmt.Fprintf(os.Stderr, "e2e: %v during a broker app restart: broker app started again, exiting\n", sig)
			os.Exit(2)
		case <-restored:
		}
	})
	defer func() {
		signal.Stop(sigs)
		close(restored)
		watcher.Wait()
	}()

	c.brokerM.Lock()
	c.stopped = true
	err := rabbitmqctl(ctx, "stop_app")
	c.brokerM.Unlock()
	defer c.restoreBroker(context.WithoutCancel(ctx))
	if err != nil {
		return err
	}
	sleep(ctx, s.Hold)
	restoreCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	c.restoreBroker(restoreCtx)
	record("rabbitmqctl stop_app, start_app")
	return nil
}

// killSessions terminates every session on the run's database, from a
// connection to the maintenance database.
func (in *injector) killSessions(ctx context.Context) (int, error) {
	conn, err := pgx.Connect(ctx, in.c.adminURL)
	if err != nil {
		return 0, fmt.Errorf("connect to terminate sessions: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	err = conn.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
		FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()`, in.c.id).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("terminate sessions: %w", err)
	}
	return n, nil
}

// sleep waits for d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

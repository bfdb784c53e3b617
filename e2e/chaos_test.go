package e2e

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// Where shipping keeps what the checker reads (services/shipping/internal:
// rabbitmq.Topology, shipment.Reason, shipment.MaxBodyBytes, metrics).
const (
	// deadLetterQueue is shipping's dead-letter queue.
	deadLetterQueue = "shipping.order-events.dlq"
	// deadLetterReasonHeader carries the reason shipping dead-lettered a
	// message; a message the broker dead-lettered itself (delivery limit)
	// has only x-death's reason, which the checker falls back to.
	deadLetterReasonHeader = "x-dead-letter-reason"
	// duplicatesMetric counts deliveries acked without a new effect, by the
	// layer that caught them (inbox record, or the shipment's own version).
	duplicatesMetric = "shipping_events_duplicate_total"
	deferredMetric   = "shipping_events_deferred_total"
	// mainQueue and delayQueue are the queues shipping consumes from and
	// defers messages through.
	mainQueue  = "shipping.order-events"
	delayQueue = "shipping.order-events.delay"
	// shipmentsCollection holds one document per applied event (order_id,
	// version, message_id, event_type, applied_at).
	shipmentsCollection = "shipment_events"
	// maxMessageBytes is shipping's limit on a message body: the oversize
	// poison exceeds it.
	maxMessageBytes = 1 << 20
)

// TestChaos runs the whole system (orders API, standalone relays, shipping
// consumers, FerretDB or a MongoDB container) as real processes against the
// real PostgreSQL and RabbitMQ, drives a retrying workload through it while
// injecting every fault of the catalogue (docs/guarantees.md) at seeded random times, heals,
// waits for the drain, and checks invariants I1-I6 over the history and the
// final state. See doc.go for the profiles and environment variables.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos suite takes minutes; not run with -short")
	}
	profile, err := chaos.ProfileFromEnv(os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	seed, err := seedFromEnv(os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("chaos: seed=%d profile=%s (reproduce the plan with CHAOS_SEED=%d CHAOS_PROFILE=%s)", seed, profile.Name, seed, profile.Name)
	provider, err := chooseProvider(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("provider: %s", provider)
	skips := &kindSkips{t: t}
	pgBinDir, pgCred, err := ownPostgresBinDir()
	if err != nil {
		t.Logf("postgres: the shared server (TEST_DATABASE_URL)")
		profile = skips.without(profile, "CHAOS_OWN_POSTGRES", fmt.Errorf("no PostgreSQL server of the run's own: %w", err), slices.Concat(chaos.OwnPostgresFaultKinds, chaos.OwnPostgresPauseAndPathKinds)...)
	} else {
		t.Logf("postgres: a cluster of the run's own (%s), restartable", pgBinDir)
	}
	profile = withoutUnavailableResourceFaults(skips, profile, provider, err)
	topo := chaos.Topology{Relays: 2, Consumers: 2}
	if profile.Name == "cluster" {
		if err := rabbitClusterAvailable(); err != nil {
			unavailable(t, "the cluster profile runs a RabbitMQ cluster of its own: %v", err)
		}
		topo.Nodes = 3
	}
	profile, topo = ownBroker(t, skips, profile, topo)
	profile, netns := partitionable(skips, profile, topo)
	plan, err := chaos.NewPlan(seed, profile, topo)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range plan {
		t.Logf("plan: %v", s)
	}

	report := runScenario(t, scenario{seed: seed, profile: profile, plan: plan, provider: provider, topo: topo,
		pgBinDir: pgBinDir, pgCred: pgCred, netns: netns, skipped: skips.list})
	if c := report.FaultsInjected; topo.Nodes > 0 {
		t.Logf("node faults: %d kill, %d kill of the queue leader, %d app restart, %d cut from the clients",
			c[chaos.FaultNodeKill], c[chaos.FaultNodeKillLeader], c[chaos.FaultNodeAppRestart], c[chaos.FaultNodeProxyDown])
	}
	path := cmp.Or(os.Getenv("CHAOS_REPORT"), chaos.DefaultReportPath)
	if err := chaos.WriteReport(path, report); err != nil {
		t.Error(err)
	}
	fmt.Println(report.Summary())
	t.Log(report.Summary())
	t.Logf("report written to %s", path)
	for i, v := range report.Violations {
		if i == 30 {
			t.Errorf("... and %d more violations in %s", report.ViolationCount-i, path)
			break
		}
		t.Errorf("violation: %v", v)
	}
}

// TestChaosCheckerSeesTampering proves the suite can fail: after a calm run
// it damages the final state behind the system's back (an applied event
// deleted from MongoDB, an effect of no committed event added, a real event
// copied into the dead-letter queue, an acknowledged order deleted from
// PostgreSQL, a second effect-log entry of an applied message, an applied
// message's inbox record deleted), and requires the report to show each one. It exercises the
// readers of the real stores, which the checker's unit tests cannot.
func TestChaosCheckerSeesTampering(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the whole system; not run with -short")
	}
	seed, err := seedFromEnv(os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	provider, err := chooseProvider(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	calm := chaos.Profile{
		Name: "tamper", Load: 5 * time.Second, Warmup: time.Second, Cooldown: time.Second,
		Clients: 2, Rate: 10, CancelRatio: 0.5,
		HoldMin: time.Millisecond, HoldMax: time.Millisecond, DrainBudget: time.Minute,
	}
	var tampered struct{ lostMsg, fakeMsg, deadMsg, deletedOrder, againMsg, unrecordedMsg string }
	report := runScenario(t, scenario{
		seed: seed, profile: calm, provider: provider, topo: chaos.Topology{Relays: 1, Consumers: 1},
		tamper: func(ctx context.Context, c *cluster, h chaos.History) error {
			// Orders acknowledged and never cancelled: damage that keeps the
			// API's view and MongoDB's alike (the API reads versions 1, 2, ...
			// up to the first gap).
			orders, err := readOrders(ctx, c.db)
			if err != nil {
				return err
			}
			created := make(map[string]bool)
			for _, o := range orders {
				created[o.ID] = o.Status == chaos.StatusCreated
			}
			var acked []chaos.Op
			for _, op := range h.Ops {
				if op.Kind == chaos.OpCreate && op.Outcome == chaos.OutcomeOK && created[op.OrderID] {
					acked = append(acked, op)
				}
			}
			if len(acked) < 4 {
				return fmt.Errorf("only %d uncancelled orders acknowledged in a calm run", len(acked))
			}
			events, _, err := readEvents(ctx, c.db)
			if err != nil {
				return err
			}
			first := func(orderID string) chaos.CommittedEvent {
				for _, e := range events {
					if e.OrderID == orderID && e.Version == 1 {
						return e
					}
				}
				return chaos.CommittedEvent{}
			}
			// 1. An effect lost: the first order's order.created record goes.
			lost := first(acked[0].OrderID)
			tampered.lostMsg = lost.MessageID
			// 2. An effect of no committed event, as the second order's v2.
			tampered.fakeMsg = "999999999"
			// 3. A real event (the third order's) in the dead-letter queue.
			dead := first(acked[2].OrderID)
			tampered.deadMsg = dead.MessageID
			// 4. An acknowledged order gone from PostgreSQL (the last one).
			tampered.deletedOrder = acked[len(acked)-1].OrderID
			// 5. The second order's order.created handled again, as an
			// inbox that deduplicates nothing would: a second entry in the
			// effect log, by a writer of no process run, with no fault.
			tampered.againMsg = first(acked[1].OrderID).MessageID
			// 6. The third order's order.created without its done record.
			tampered.unrecordedMsg = dead.MessageID

			client, err := mongo.Connect(options.Client().ApplyURI("mongodb://" + c.mongo.addr() + "/" + c.mongo.uriQuery()))
			if err != nil {
				return err
			}
			defer func() { _ = client.Disconnect(context.WithoutCancel(ctx)) }()
			coll := client.Database(c.id).Collection(shipmentsCollection)
			if res, err := coll.DeleteOne(ctx, bson.D{{Key: "message_id", Value: lost.MessageID}}); err != nil || res.DeletedCount != 1 {
				return fmt.Errorf("delete applied event %s: %v (%d deleted)", lost.MessageID, err, res.DeletedCount)
			}
			if _, err := coll.InsertOne(ctx, bson.D{
				{Key: "_id", Value: acked[1].OrderID + "/2"}, {Key: "order_id", Value: acked[1].OrderID},
				{Key: "version", Value: int64(2)}, {Key: "message_id", Value: tampered.fakeMsg},
				{Key: "event_type", Value: chaos.EventCancelled}, {Key: "applied_at", Value: time.Now()},
			}); err != nil {
				return fmt.Errorf("insert a fake effect: %w", err)
			}
			var entry bson.M
			if err := client.Database(c.id).Collection(effectLogCollection).FindOne(ctx, bson.D{{Key: "message_id", Value: tampered.againMsg}}).Decode(&entry); err != nil {
				return fmt.Errorf("read the effect log of %s: %w", tampered.againMsg, err)
			}
			entry["_id"], entry["writer"] = bson.NewObjectID(), "planted/0"
			entry["started_at"], entry["at"] = time.Now(), time.Now()
			if _, err := client.Database(c.id).Collection(effectLogCollection).InsertOne(ctx, entry); err != nil {
				return fmt.Errorf("plant a second effect-log entry: %w", err)
			}
			if res, err := client.Database(c.id).Collection(inboxCollection).DeleteOne(ctx,
				bson.D{{Key: "_id", Value: inboxConsumer + "/" + tampered.unrecordedMsg}}); err != nil || res.DeletedCount != 1 {
				return fmt.Errorf("delete the inbox record of %s: %v (%v)", tampered.unrecordedMsg, err, res)
			}
			if err := publishConfirmed(ctx, c.amqpURL, "", amqp.Publishing{MessageId: dead.MessageID, Body: []byte("{}")}, deadLetterQueue); err != nil {
				return fmt.Errorf("copy event %s into the dead-letter queue: %w", dead.MessageID, err)
			}
			_, err = c.db.Exec(ctx, `
				WITH o AS (DELETE FROM orders WHERE id = $1::uuid RETURNING id)
				DELETE FROM idempotency_keys WHERE order_id IN (SELECT id FROM o)`, tampered.deletedOrder)
			return err
		},
	})

	t.Log(report.Summary())
	want := []struct{ invariant, kind, messageID, orderID string }{
		{"I2", "lost", tampered.lostMsg, ""},
		{"I2", "unknown_effect", tampered.fakeMsg, ""},
		{"I6", "unexpected_dead_letter", tampered.deadMsg, ""},
		{"I1", "acknowledged_not_committed", "", tampered.deletedOrder},
		{"I2", "duplicate_effect", tampered.againMsg, ""},
		{"I2", "effect_without_inbox_record", tampered.unrecordedMsg, ""},
	}
	for _, w := range want {
		found := false
		for _, v := range report.Violations {
			found = found || v.Invariant == w.invariant && v.Kind == w.kind &&
				(w.messageID == "" || v.MessageID == w.messageID) && (w.orderID == "" || v.OrderID == w.orderID)
		}
		if !found {
			t.Errorf("report misses %s %s (message %q, order %q): %v", w.invariant, w.kind, w.messageID, w.orderID, report.Violations)
		}
	}
	if report.Lost != 1 || report.UnexpectedDeadLetters != 1 || report.AcknowledgedNotCommitted != 1 ||
		report.DuplicateEffects != 1 || report.WitnessDuplicatesUnexplained != 1 || !report.EffectsAudited {
		t.Errorf("lost=%d unexpected_dead_letters=%d acknowledged_not_committed=%d duplicate_effects=%d witness_again_unexplained=%d; want 1 each (audited %v)",
			report.Lost, report.UnexpectedDeadLetters, report.AcknowledgedNotCommitted, report.DuplicateEffects,
			report.WitnessDuplicatesUnexplained, report.EffectsAudited)
	}
	if report.WitnessEntries == 0 || report.InboxRecords == 0 {
		t.Errorf("witness=%d inbox_records=%d: the audit read nothing", report.WitnessEntries, report.InboxRecords)
	}
}

// scenario is one run of the system.
type scenario struct {
	seed     int64
	profile  chaos.Profile
	plan     []chaos.Step
	provider string
	topo     chaos.Topology
	pgBinDir string // see clusterConfig
	pgCred   *syscall.Credential
	netns    bool // see clusterConfig.rabbitNetns
	// skipped are the profile's kinds this machine could not inject, for
	// the report's identity.
	skipped []chaos.SkippedKinds
	// tamper, when set, runs after the drain and before the final state is
	// read.
	tamper func(ctx context.Context, c *cluster, h chaos.History) error
}

// runScenario starts a cluster, runs the workload and the fault plan, heals,
// drains, reads the final state and checks it. Harness failures (a fault
// that could not be injected, a service log showing a panic or a data race)
// fail t; the invariants are the report's.
func runScenario(t *testing.T, sc scenario) chaos.Report {
	t.Helper()
	requireServices(t, sc.pgBinDir == "")
	identity := runIdentity(sc)
	bins := buildBinaries(t)
	c := newCluster(t, clusterConfig{
		provider: sc.provider, relays: sc.topo.Relays, consumers: sc.topo.Consumers, bins: bins,
		pgBinDir: sc.pgBinDir, pgCred: sc.pgCred, rabbitNodes: sc.topo.Nodes, rabbitNetns: sc.netns,
	})

	// Finish well before go test's -timeout: its panic skips every cleanup,
	// and cleanups are what restore the machine's services.
	ctx := t.Context()
	if dl, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl.Add(-90*time.Second))
		defer cancel()
	}
	// Every fault is healed on the way out, whatever happened.
	defer func() { _ = c.healAll(context.WithoutCancel(ctx)) }()
	c.assertQuorumQueues(ctx, "before the faults")

	// The publish-order tap, declared before any event is published.
	direct, err := c.directAMQPURLs() // the tap's and the poisoner's
	if err != nil {
		t.Fatal(err)
	}
	tap, err := startPublishTap(ctx, direct, c.rabbit != nil, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	defer tap.stop()

	rec := &chaos.Recorder{}
	poison := &poisoner{amqpURLs: direct, runID: c.id, oversize: maxMessageBytes + 1024}
	in := newInjector(c, rec, poison, t.Logf)
	dupes := newDuplicateScraper(c.shipping, c.shipURLs)
	scrapeCtx, stopScrape := context.WithCancel(ctx)
	var scrapeWG sync.WaitGroup
	scrapeWG.Go(func() { dupes.run(scrapeCtx) })
	defer func() { stopScrape(); scrapeWG.Wait() }()

	wl, err := chaos.NewWorkload(chaos.WorkloadConfig{
		BaseURL: c.ordersURL, Recorder: rec, KeyPrefix: c.id, Seed: sc.seed,
		Clients: sc.profile.Clients, Rate: sc.profile.Rate, CancelRatio: sc.profile.CancelRatio,
		AmendRatio: sc.profile.AmendRatio,
	})
	if err != nil {
		t.Fatal(err)
	}
	in.burst = wl.Burst
	start := time.Now()
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	var loadWG sync.WaitGroup
	loadWG.Go(func() { _ = wl.Run(loadCtx) })

	faultErr := in.run(ctx, start, sc.plan)
	sleep(ctx, time.Until(start.Add(sc.profile.Load)))
	stopLoad()
	loadWG.Wait() // operations in flight finish (within their timeout)
	loadEnd := time.Now()
	if faultErr != nil {
		t.Errorf("fault injection: %v", faultErr)
	}

	healCtx, cancelHeal := context.WithTimeout(ctx, 3*time.Minute)
	if err := c.healAll(healCtx); err != nil {
		t.Errorf("heal: %v", err)
	}
	cancelHeal()
	h := rec.History()
	since := loadEnd
	if last := h.LastFaultEnd(); last.After(since) {
		since = last
	}
	t.Logf("load: %d operations in %v; healed; draining", len(h.Ops), loadEnd.Sub(start).Round(time.Second))

	drained, drainTime := c.waitDrain(ctx, since, 2*sc.profile.DrainBudget)
	stopScrape()
	scrapeWG.Wait()
	c.assertQuorumQueues(ctx, "after the drain")

	if sc.tamper != nil {
		if err := sc.tamper(ctx, c, h); err != nil {
			t.Fatalf("tamper: %v", err)
		}
	}
	state, err := c.finalState(ctx, h, dupes, sc.seed)
	if err != nil {
		t.Fatalf("read the final state: %v", err)
	}
	if state.PublishOrder, err = tap.finish(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("publish-order tap: %d message ids, %d reconnects", len(state.PublishOrder.Sightings), state.PublishOrder.Reconnects)
	report := chaos.Check(h, state, chaos.RunInfo{
		Seed: sc.seed, Profile: sc.profile.Name, Provider: sc.provider,
		Drained: drained, DrainTime: drainTime, DrainBudget: sc.profile.DrainBudget,
		RequireKinds: sc.profile.Kinds, RequireDuplicates: len(sc.plan) > 0,
		Identity:          identity,
		InboxTransactions: sc.provider == providerTestcontainers, InboxRecordWindow: inboxRecordWindow,
	})
	// An unknown event type is acknowledged (the queues drained, and the
	// checker requires it absent from the dead-letter queue), recorded as a
	// no-op at its version, and logged. The
	// line is written after the record: a shipping process killed between
	// the two loses it, and the redelivery is absorbed as a duplicate, so a
	// missing line counts only when no shipping process died after the
	// poison was sent.
	for _, p := range h.Poison {
		if p.Kind != chaos.PoisonUnknownType {
			continue
		}
		recorded, err := c.recordedNoOp(ctx, p)
		if err != nil {
			t.Error(err)
		} else if !recorded {
			t.Errorf("poison %s (%s, message %s) is not recorded as a no-op at its version", p.ID, p.Kind, p.MessageID)
		}
		logged, err := c.shippingLogged(p.MessageID, "unknown")
		switch {
		case err != nil:
			t.Error(err)
		case !logged && shippingDiedAfter(h.Faults, p.At):
			t.Logf("poison %s (%s) recorded but not logged: a shipping process died after it was sent", p.ID, p.Kind)
		case !logged:
			t.Errorf("poison %s (%s, message %s) was not logged by shipping", p.ID, p.Kind, p.MessageID)
		}
	}
	for _, ev := range c.unexpectedExits() {
		t.Logf("a process exited on its own (restarted): %s #%d at %s: %s; its last lines:\n%s",
			ev.proc, ev.incarnation, ev.at.Format(time.TimeOnly), ev.status, ev.logTail)
	}
	for name, p := range c.procs {
		problems, err := logProblems(p.log.Name())
		if err != nil {
			t.Error(err)
		}
		for _, line := range problems {
			t.Errorf("%s: %s", name, line)
		}
	}
	return report
}

// shippingLogged tells whether a shipping consumer logged a line holding
// both messageID and word (case-insensitive).
// recordedNoOp says p, an unknown event type, is recorded at version 1 in
// shipping's MongoDB, as the no-op that lets its aggregate's later versions
// apply.
func (c *cluster) recordedNoOp(ctx context.Context, p chaos.Poison) (bool, error) {
	client, err := mongo.Connect(options.Client().ApplyURI("mongodb://" + c.mongo.addr() + "/" + c.mongo.uriQuery()).
		SetServerSelectionTimeout(30 * time.Second))
	if err != nil {
		return false, fmt.Errorf("look for poison %s's record: %w", p.ID, err)
	}
	defer func() { _ = client.Disconnect(context.WithoutCancel(ctx)) }()
	n, err := client.Database(c.id).Collection(shipmentsCollection).CountDocuments(ctx,
		bson.D{{Key: "message_id", Value: p.MessageID}, {Key: "version", Value: 1}})
	if err != nil {
		return false, fmt.Errorf("look for poison %s's record: %w", p.ID, err)
	}
	return n == 1, nil
}

// shippingDiedAfter says a shipping process was killed, or stopped at a
// crash point, after t.
func shippingDiedAfter(faults []chaos.Fault, t time.Time) bool {
	for _, f := range faults {
		switch f.Kind {
		case chaos.FaultKillShipping, chaos.FaultCrashShippingAfterEffect, chaos.FaultCrashShippingAfterInbox:
			if !f.End.Before(t) {
				return true
			}
		}
	}
	return false
}

func (c *cluster) shippingLogged(messageID, word string) (bool, error) {
	for _, p := range c.shipping {
		b, err := os.ReadFile(p.log.Name())
		if err != nil {
			return false, fmt.Errorf("read %s's log: %w", p.spec.name, err)
		}
		for line := range strings.SplitSeq(string(b), "\n") {
			if strings.Contains(line, messageID) && strings.Contains(strings.ToLower(line), word) {
				return true, nil
			}
		}
	}
	return false, nil
}

// seedFromEnv returns CHAOS_SEED, or a random seed.
func seedFromEnv(getenv func(string) string) (int64, error) {
	s := getenv("CHAOS_SEED")
	if s == "" {
		return rand.Int64N(1 << 62), nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("CHAOS_SEED=%q: want an integer", s)
	}
	return n, nil
}

// healAll resumes every paused process, removes every toxic, enables every
// proxy, starts the broker app if it is stopped and every process that is
// down.
func (c *cluster) healAll(ctx context.Context) error {
	var errs []error
	c.resumeAll()
	c.restoreBroker(ctx)
	if err := c.toxi.heal(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := c.ensureAllRunning(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := c.resetServerSettings(ctx); err != nil { // the resource faults' settings
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// waitDrain waits until the system is quiescent: nothing pending in the
// outbox, and no message ready or unacknowledged in any queue but the
// dead-letter queue, on two polls in a row a second apart. Nothing can then
// still reach shipping, so what it holds is final: a committed event without
// an effect is lost, not late. It returns whether that happened within limit,
// and when, counted from since.
func (c *cluster) waitDrain(ctx context.Context, since time.Time, limit time.Duration) (bool, time.Duration) {
	ctx, cancel := context.WithDeadline(ctx, since.Add(limit))
	defer cancel()
	var (
		quiet        time.Time // first of the quiescent polls in a row
		lastLog      time.Time
		lastProgress string
	)
	for {
		progress, err := c.busy(ctx)
		if err != nil {
			progress = "cannot tell: " + err.Error() // never taken for quiet
		}
		switch {
		case progress != "":
			quiet = time.Time{}
		case quiet.IsZero():
			quiet = time.Now()
		default:
			return true, quiet.Sub(since)
		}
		if progress != "" && (progress != lastProgress && time.Since(lastLog) > 5*time.Second || time.Since(lastLog) > 15*time.Second) {
			c.t.Logf("drain t+%.1fs: %s", time.Since(since).Seconds(), progress)
			lastLog, lastProgress = time.Now(), progress
		}
		select {
		case <-ctx.Done():
			c.t.Logf("drain: not quiescent after %v: %s", limit, progress)
			return false, time.Since(since)
		case <-time.After(time.Second):
		}
	}
}

// busy says what is still in flight, "" when nothing is.
func (c *cluster) busy(ctx context.Context) (string, error) {
	var pending int
	if err := c.db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE dead_lettered_at IS NULL`).Scan(&pending); err != nil {
		return "", fmt.Errorf("count pending outbox rows: %w", err)
	}
	if pending > 0 {
		return fmt.Sprintf("%d events pending in the outbox", pending), nil
	}
	// Ready counts come cheap over AMQP; only when nothing is ready ask
	// rabbitmqctl (an Erlang VM per call) for the unacknowledged ones too.
	consumed := []string{mainQueue, delayQueue}
	ready, err := readyCounts(ctx, c.amqpURL, consumed...)
	if err != nil {
		return "", err
	}
	var waiting []string
	for _, q := range consumed {
		if ready[q] > 0 {
			waiting = append(waiting, fmt.Sprintf("%s=%d", q, ready[q]))
		}
	}
	if len(waiting) > 0 {
		msg := "messages ready in queues: " + strings.Join(waiting, " ")
		if ready[delayQueue] > 0 {
			// Waiting out the delay, or deferred again and again: the
			// counters tell (a count that grows while the queue stays
			// full is a message going round). Counters that stand still
			// while messages stay ready: ask the queue when its head
			// expires (a broker that stopped expiring them).
			d := c.deferrals(ctx)
			msg += "; shipping's deferrals so far: " + d
			if d == c.lastDeferrals {
				msg += "; " + c.delayQueueHead(ctx)
			}
			c.lastDeferrals = d
		}
		return msg, nil
	}
	depths, err := c.queueDepths(ctx)
	if err != nil {
		return "", err
	}
	var busy []string
	for q, n := range depths {
		if n > 0 && q != deadLetterQueue && q != publishTapQueue {
			busy = append(busy, fmt.Sprintf("%s=%d", q, n))
		}
	}
	slices.Sort(busy)
	if len(busy) > 0 {
		return "messages in queues (ready + unacked): " + strings.Join(busy, " "), nil
	}
	return "", nil
}

// deferrals reads shipping's deferral counters by reason, summed over the
// consumers that answer now (a restarted one counts from zero).
func (c *cluster) deferrals(ctx context.Context) string {
	client := &http.Client{Timeout: time.Second}
	defer client.CloseIdleConnections()
	sum := make(map[string]float64)
	for _, u := range c.shipURLs {
		exposition, ok := fetchMetrics(ctx, client, u+"/metrics")
		if !ok {
			continue
		}
		for reason, v := range scrapeCounterBy(exposition, deferredMetric, "reason") {
			sum[reason] += v
		}
	}
	var parts []string
	for _, reason := range slices.Sorted(maps.Keys(sum)) {
		parts = append(parts, fmt.Sprintf("%s=%d", reason, int64(sum[reason])))
	}
	if len(parts) == 0 {
		return "none read"
	}
	return strings.Join(parts, " ")
}

// delayQueueHead reads from the delay queue's Raft state (RabbitMQ 3.10's
// quorum queue machine, asked on its leader) how many messages are ready
// and when the one at its head expires. A head that expired seconds ago
// while messages stay ready is a broker that stopped expiring them; a head
// still to expire is a queue that is being fed.
func (c *cluster) delayQueueHead(ctx context.Context) string {
	expr := fmt.Sprintf(`case rabbit_amqqueue:lookup(rabbit_misc:r(<<%q>>, queue, <<%q>>)) of
		{ok, Q} ->
			{R, _} = amqqueue:get_pid(Q),
			F = fun(S) -> {rabbit_fifo:query_messages_ready(S),
				case rabbit_fifo:query_peek(1, S) of {ok, [_ | H]} -> rabbit_fifo:get_header(expiry, H); _ -> none end} end,
			case catch ra:leader_query({R, node()}, F) of
				{ok, {_, {Ready, Exp}}, _} -> io:format("~p ~p ~p~n", [Ready, Exp, erlang:system_time(millisecond)]);
				Other -> io:format("error ~p~n", [Other])
			end;
		_ -> io:format("error not found~n")
	end, ok.`, c.vhost, delayQueue)
	out, err := c.ctl(ctx, "eval", expr)
	if err != nil {
		return "delay queue's head: " + err.Error()
	}
	var ready, expiry, now int64
	if n, _ := fmt.Sscanf(strings.TrimSpace(out), "%d %d %d", &ready, &expiry, &now); n != 3 {
		return "delay queue's head: " + strings.TrimSpace(out)
	}
	if expiry <= now {
		return fmt.Sprintf("delay queue: %d ready, its head expired %.1fs ago and is still there", ready, float64(now-expiry)/1000)
	}
	return fmt.Sprintf("delay queue: %d ready, its head expires in %.1fs", ready, float64(expiry-now)/1000)
}

// finalState reads what the checker needs, after the drain: orders and
// outbox rows from PostgreSQL, shipments from shipping's MongoDB collection
// (cross-checked on a sample against GET /shipments/{id}), the dead-letter
// queue's contents and the duplicates the consumers absorbed.
func (c *cluster) finalState(ctx context.Context, h chaos.History, dupes *duplicateScraper, seed int64) (chaos.FinalState, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Minute)
	defer cancel()
	var s chaos.FinalState
	var err error
	if s.Orders, err = readOrders(ctx, c.db); err != nil {
		return s, err
	}
	if s.Events, _, err = readEvents(ctx, c.db); err != nil {
		return s, err
	}
	shipments, err := readShipments(ctx, "mongodb://"+c.mongo.addr()+"/"+c.mongo.uriQuery(), c.id, shipmentsCollection)
	if err != nil {
		return s, err
	}
	for _, id := range slices.Sorted(maps.Keys(shipments)) {
		s.Shipments = append(s.Shipments, shipments[id])
	}
	if err := c.checkAPIAgrees(ctx, s.Orders, h.Poison, shipments, seed); err != nil {
		return s, err
	}
	if s.DeadLetters, err = drainDeadLetters(ctx, c.amqpURL, deadLetterQueue, deadLetterReasonHeader); err != nil {
		return s, err
	}
	s.DuplicatesDelivered = dupes.total()
	s.DeadPrimaries = c.deadPrimaries
	if s.Effects, err = c.readEffectsAudit(ctx, dupes); err != nil {
		return s, err
	}
	return s, nil
}

// checkAPIAgrees compares GET /shipments/{id} with what MongoDB holds, for a
// sample of orders and every poison message's fake order: the checker reads
// MongoDB, the contract is the API.
func (c *cluster) checkAPIAgrees(ctx context.Context, orders []chaos.CommittedOrder, poison []chaos.Poison, stored map[string]chaos.Shipment, seed int64) error {
	rng := rand.New(rand.NewPCG(uint64(seed), 1))
	var ids []string
	for _, i := range rng.Perm(len(orders))[:min(len(orders), apiSample)] {
		ids = append(ids, orders[i].ID)
	}
	for _, p := range poison {
		ids = append(ids, p.OrderID)
	}
	reader := &shipmentReader{urls: c.shipURLs, client: &http.Client{}}
	defer reader.client.CloseIdleConnections()
	got, err := reader.getAll(ctx, ids)
	if err != nil {
		return err
	}
	for _, id := range ids {
		want := versionOrder(stored[id].Events)
		if api := versionOrder(got[id].Events); !slices.Equal(api, want) {
			return fmt.Errorf("GET /shipments/%s lists events %v, MongoDB holds %v", id, api, want)
		}
	}
	return nil
}

// apiSample is how many orders checkAPIAgrees asks the API about.
const apiSample = 100

// versionOrder lists events as "message_id:version", sorted by version: the
// API lists a shipment's events by version.
func versionOrder(events []chaos.AppliedEvent) []string {
	events = slices.Clone(events)
	slices.SortStableFunc(events, func(a, b chaos.AppliedEvent) int { return cmp.Compare(a.Version, b.Version) })
	out := make([]string, len(events))
	for i, e := range events {
		out[i] = e.MessageID + ":" + strconv.FormatInt(e.Version, 10)
	}
	return out
}

// duplicateScraper reads shipping's duplicates counter from each consumer
// every second. A counter restarts at zero with its process, so the scraper
// keeps the last value seen of each incarnation and sums them.
type duplicateScraper struct {
	procs  []*proc
	urls   []string
	client *http.Client

	mu   sync.Mutex
	last map[string]map[string]float64 // "proc#incarnation" -> layer -> last value
}

func newDuplicateScraper(procs []*proc, urls []string) *duplicateScraper {
	return &duplicateScraper{procs: procs, urls: urls, client: &http.Client{Timeout: time.Second}, last: make(map[string]map[string]float64)}
}

func (d *duplicateScraper) run(ctx context.Context) {
	defer d.client.CloseIdleConnections()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		d.scrape(ctx)
		select {
		case <-ctx.Done():
			d.scrape(context.WithoutCancel(ctx)) // one last look
			return
		case <-t.C:
		}
	}
}

func (d *duplicateScraper) scrape(ctx context.Context) {
	for i, p := range d.procs {
		before := p.current()
		if before == nil {
			continue
		}
		byLayer, ok := d.read(ctx, d.urls[i]+"/metrics")
		if !ok || p.current() != before {
			continue // down, or restarted while we read: not attributable
		}
		d.mu.Lock()
		key := p.spec.name + "#" + strconv.Itoa(before.n)
		if d.last[key] == nil {
			d.last[key] = make(map[string]float64)
		}
		for layer, v := range byLayer {
			d.last[key][layer] = max(d.last[key][layer], v)
		}
		d.mu.Unlock()
	}
}

func (d *duplicateScraper) read(ctx context.Context, url string) (map[string]float64, bool) {
	b, ok := fetchMetrics(ctx, d.client, url)
	if !ok {
		return nil, false
	}
	if _, ok := scrapeCounter(b, duplicatesMetric); !ok {
		return nil, false
	}
	return scrapeCounterBy(b, duplicatesMetric, "layer"), true
}

// fetchMetrics GETs a Prometheus exposition; ok is false on any failure.
func fetchMetrics(ctx context.Context, client *http.Client, url string) (string, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", false
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", false
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil || resp.StatusCode != http.StatusOK {
		return "", false
	}
	return string(b), true
}

// total is the duplicates absorbed, every layer.
func (d *duplicateScraper) total() int64 {
	var sum int64
	for _, v := range d.byLayer() {
		sum += v
	}
	return sum
}

// byLayer is the duplicates absorbed by layer (inbox, version).
func (d *duplicateScraper) byLayer() map[string]int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	sum := make(map[string]float64)
	for _, layers := range d.last {
		for layer, v := range layers {
			sum[layer] += v
		}
	}
	out := make(map[string]int64, len(sum))
	for layer, v := range sum {
		out[layer] = int64(v)
	}
	return out
}

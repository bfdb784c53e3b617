// Package inboxcheck tests a handler written for package inbox the way an
// at-least-once broker will treat it, against a real MongoDB (or FerretDB),
// and fails the test when the handler's effect is applied twice, lost, or
// applied out of order, or when the handler breaks a rule of the inbox's
// mode.
//
// Give it the handler, and a way to read its effect, on a database whose
// client has the check's command monitor (Monitor):
//
//	func TestShipmentHandler(t *testing.T) {
//		client, err := mongo.Connect(options.Client().ApplyURI(uri).SetMonitor(inboxcheck.Monitor(nil)))
//		...
//		db := client.Database(...) // a database of the test's own
//		inboxcheck.Run(t, db, inboxcheck.Subject{
//			Handler: func(m inboxcheck.Message) inbox.Handler {
//				return func(ctx context.Context) error {
//					return shipments.Apply(ctx, eventFor(m)) // version m.Version of order m.AggregateID
//				}
//			},
//			Applied: func(ctx context.Context, orderID string) ([]string, error) {
//				return shipments.MessageIDs(ctx, orderID) // in the order they were applied
//			},
//		})
//	}
//
// Run delivers messages of fresh aggregates (versions 1, 2, ... of each)
// through inboxes configured as Subject.Inbox says, in each of these
// scenarios, then reads every aggregate's effect and wants each message
// applied exactly once, in version order (in any order when the subject
// declares its effect order-insensitive, Subject.OrderInsensitive: a set of
// facts, a sum):
//
//   - redelivered: each message delivered twice in a row, the second time
//     to another consumer instance (whose done cache is empty).
//   - crash_window: the first delivery of each message runs the handler and
//     fails after it, before the inbox records the message: what a consumer
//     killed between its effect and its record leaves (in ModeTransaction the
//     effect is rolled back with the transaction; in ModeStandalone it stays,
//     and the redelivery must find it applied).
//   - crash_inside: the consumer dies inside the handler, between two of
//     its database commands: for k = 1, 2, ... (fresh aggregates for each
//     k, whose names end in -k<k>-<n>) the first delivery of each message
//     is interrupted after the handler's k-th command (the Monitor counts
//     them and then cancels the handler's context, so no later command of
//     it reaches the server), then the message is delivered again until
//     acknowledged; k grows until no handler makes k commands. A handler
//     that writes a "done" marker of its own and then its effect, in two
//     writes, loses the effect here: the redelivery finds the marker and
//     the inbox records the message (Lost).
//   - concurrent: each message delivered to two consumer instances at the
//     same time; in ModeStandalone without a Lease both handlers run at once
//     (the check makes them meet inside the handler).
//   - out_of_order: each aggregate's versions delivered last first; a
//     delivery whose handler fails is delivered again after the others, as a
//     broker redelivers a rejected message. An order-sensitive handler must
//     hold a version back until the one before it is applied; an
//     order-insensitive one must still apply each once.
//   - shuffled: each aggregate's versions delivered in swapped pairs (2, 1,
//     4, 3, ...), each delivery made twice in a row, the second to another
//     consumer instance; a delivery that fails (a gap) is delivered again
//     after the others. An order-blind handler fails it; one behind a
//     version gate (Subject.Gate) must pass it.
//   - foreign_context: one delivery of each message whose handler gets a
//     context cancelled before it runs: a handler that still applies its
//     effect does its database work with another context. In ModeTransaction
//     such writes commit outside the transaction, even when it aborts.
//   - expired_record: every message delivered again, once applied, to a
//     consumer without its record: what a redelivery after retention expired
//     the record meets. The handler must find its effect and do nothing (in
//     ModeTransaction it must read before it writes: a duplicate key aborts
//     the transaction).
//
// With Subject.Gate, every delivery goes through the gate it returns
// (inbox.Gate), at the message's aggregate and version, in every scenario:
// the handler may then be blind to order, and the check tests the gate; a
// gate that lets a version through before its predecessor fails
// out_of_order and shuffled.
//
// A delivery whose Process call fails is delivered again, up to
// MaxDeliveries times; a message still not acknowledged then is reported
// (a handler that fails for good, or keeps aborting its transaction by
// swallowing a write error).
//
// What is checked where: every scenario runs in the mode the inbox resolves
// (ModeAuto asks the server). On a standalone server or FerretDB that is
// ModeStandalone: idempotence under redelivery, crash and concurrency,
// version order, and the context rule (foreign_context). What only a
// replica set shows is checked only there, in ModeTransaction: that the
// handler's writes roll back with an aborted transaction (crash_window),
// that it reads before it writes (expired_record), that it does not swallow
// write errors (they abort the transaction, and the message is never
// acknowledged). Run your handler's check on a replica set too if it will
// run on one.
//
// The check probes what the server under it can show, and lists in
// Report.Unchecked (Run logs them) what it could not check there, as
// "<scenario>: not checkable on this server: <reason>"; a scenario listed
// there has not been passed, whatever its findings:
//
//   - without transactions (ModeStandalone), crash_window and
//     expired_record, for the transaction rules above;
//   - concurrent, where concurrent updates of one document are not atomic:
//     before the scenarios, goroutines make concurrent $inc updates of one
//     document (in a collection of the run's own, dropped afterwards), and
//     if the document lost any acknowledged one (FerretDB does: two of its
//     updates of one document can both read the old value, and one undoes
//     the other), two concurrent runs of a handler that both update one
//     document can show as one. A naive counter (check the document's list
//     of applied messages, then $inc and $push) is then applied twice and
//     may look applied once. A handler whose effect adds a document per run
//     is still caught there: its double run shows whatever the server.
//
// The package needs only package inbox and the MongoDB driver: the caller
// gives it the database, on any server. It writes inbox records under
// consumer names of its own (inboxcheck-<random>) in Subject.Inbox's
// collection, and leaves them there.
package inboxcheck

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/event"
	"go.mongodb.org/mongo-driver/v2/mongo"

	"github.com/outbox-inbox/reference/pkg/inbox"
)

// Message is one message the check delivers.
type Message struct {
	// ID is the message id, unique in the run.
	ID string
	// AggregateID names the aggregate, fresh for each scenario.
	AggregateID string
	// Version is the message's version within its aggregate: 1, 2, ...
	Version int64
}

// Subject is the handler under test.
type Subject struct {
	// Handler returns the handler applying m, for one delivery. Required.
	Handler func(m Message) inbox.Handler
	// Applied returns the ids of the messages whose effect the aggregate
	// shows, in the order they were applied, an id as many times as its
	// effect was applied. Required.
	Applied func(ctx context.Context, aggregateID string) ([]string, error)
	// Inbox configures the inboxes the messages go through (Mode,
	// Standalone, Collection...); Consumer is replaced by names of the
	// check's own. Default: the zero Config (ModeAuto).
	Inbox inbox.Config
	// Versions is how many messages each aggregate gets. Default 2.
	Versions int
	// Aggregates is how many aggregates each scenario uses. Default 3.
	Aggregates int
	// MaxDeliveries bounds the deliveries of one message. Default 20.
	MaxDeliveries int
	// Gate, when set, returns the version gate each delivery goes through,
	// for each inbox the check makes (Process is called with the message's
	// AggregateID and Version as its Position):
	//
	//	Gate: func(in *inbox.Inbox) (inboxcheck.Gate, error) { return inbox.NewGate(in, inbox.GateConfig{}) },
	//
	// Default: nil, deliveries go through Inbox.Process.
	Gate func(in *inbox.Inbox) (Gate, error)
	// OrderInsensitive says the handler's effect does not depend on the
	// order its messages are applied in (a set of facts, a sum): the check
	// then wants each message applied once, in any order, and reports no
	// OutOfOrder finding. By default an effect is order-sensitive: each
	// aggregate's messages must be applied in version order.
	OrderInsensitive bool
}

// Gate is a version gate, as *inbox.Gate is.
type Gate interface {
	Process(ctx context.Context, msgID string, pos inbox.Position, h inbox.Handler) (inbox.Result, error)
}

// Problems a Finding reports.
const (
	AppliedTwice      = "applied twice"
	Lost              = "lost"
	OutOfOrder        = "out of order"
	NeverAcknowledged = "never acknowledged"
	ForeignContext    = "applied with another context"
	Unexpected        = "unexpected effect"
)

// Finding is one way the handler failed a scenario.
type Finding struct {
	Scenario    string
	AggregateID string
	Problem     string
	Detail      string
}

func (f Finding) String() string {
	return fmt.Sprintf("%s: aggregate %s: %s: %s", f.Scenario, f.AggregateID, f.Problem, f.Detail)
}

// Unchecked is what a scenario could not show on the server under the
// check (or in the inboxes' mode): not a pass.
type Unchecked struct {
	Scenario string
	Reason   string
}

func (u Unchecked) String() string {
	return fmt.Sprintf("%s: not checkable on this server: %s", u.Scenario, u.Reason)
}

// Report is what a check found.
type Report struct {
	// Mode is the mode the inboxes ran in.
	Mode inbox.Mode
	// Gated: the deliveries went through Subject.Gate.
	Gated bool
	// Deliveries counts the Process calls made.
	Deliveries int
	// Crashes counts the deliveries crash_inside interrupted inside the
	// handler, after one of its database commands.
	Crashes  int
	Findings []Finding
	// Unchecked lists what the server under the check (or the inboxes'
	// mode) could not show: a handler without findings has not passed
	// these.
	Unchecked []Unchecked

	orderInsensitive bool
}

func (r *Report) String() string {
	var lines []string
	if len(r.Findings) == 0 {
		clean := "every message applied once, in order"
		if r.orderInsensitive {
			clean = "every message applied once (order not checked: Subject.OrderInsensitive)"
		}
		lines = append(lines, fmt.Sprintf("inboxcheck: %s mode%s, %d deliveries: %s", r.Mode, r.gated(), r.Deliveries, clean))
	} else {
		lines = append(lines, fmt.Sprintf("inboxcheck: %s mode%s, %d deliveries: %d findings", r.Mode, r.gated(), r.Deliveries, len(r.Findings)))
	}
	for _, f := range r.Findings {
		lines = append(lines, "  "+f.String())
	}
	for _, u := range r.Unchecked {
		lines = append(lines, "  "+u.String())
	}
	return strings.Join(lines, "\n")
}

func (r *Report) gated() string {
	if r.Gated {
		return " through a version gate"
	}
	return ""
}

// Run checks s on db and fails t with each finding (t.Errorf), or with the
// check's own error (t.Fatalf). It returns the report.
func Run(t testing.TB, db *mongo.Database, s Subject) *Report {
	t.Helper()
	r, err := Check(t.Context(), db, s)
	if err != nil {
		t.Fatalf("inboxcheck: %v", err)
		return r
	}
	for _, f := range r.Findings {
		t.Errorf("inboxcheck: %s", f)
	}
	for _, u := range r.Unchecked {
		t.Logf("inboxcheck: %s", u)
	}
	return r
}

// Check runs every scenario on db and returns what it found. Its error is
// the check's own failure (a bad Subject, the database unreachable, the
// context ended), not the handler's.
func Check(ctx context.Context, db *mongo.Database, s Subject) (*Report, error) {
	if db == nil || s.Handler == nil || s.Applied == nil {
		return nil, errors.New("inboxcheck: a database, Subject.Handler and Subject.Applied are required")
	}
	if s.Versions < 0 || s.Aggregates < 0 || s.MaxDeliveries < 0 {
		return nil, fmt.Errorf("inboxcheck: Versions %d, Aggregates %d, MaxDeliveries %d: want positive numbers (or 0 for the defaults)",
			s.Versions, s.Aggregates, s.MaxDeliveries)
	}
	s.Versions = cmp.Or(s.Versions, 2)
	s.Aggregates = cmp.Or(s.Aggregates, 3)
	s.MaxDeliveries = cmp.Or(s.MaxDeliveries, 20)
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	c := &checker{db: db, s: s, run: "inboxcheck-" + hex.EncodeToString(b), report: &Report{orderInsensitive: s.OrderInsensitive, Gated: s.Gate != nil},
		gaveUp: map[string]bool{}, gates: map[*inbox.Inbox]Gate{}}
	switch ok, err := monitored(ctx, db); {
	case err != nil:
		return nil, err
	case !ok:
		return nil, errors.New("inboxcheck: the database's client has no inboxcheck.Monitor, through which the check interrupts the handler between its database commands: connect with options.Client().SetMonitor(inboxcheck.Monitor(nil))")
	}
	probe, err := c.inbox("probe")
	if err != nil {
		return nil, err
	}
	if c.report.Mode, err = probe.Mode(ctx); err != nil {
		return nil, fmt.Errorf("inboxcheck: the inbox's mode: %w", err)
	}
	if err := c.capabilities(ctx); err != nil {
		return nil, err
	}
	for _, sc := range []struct {
		name string
		run  func(context.Context, string, [][]Message) error
	}{
		{"redelivered", c.redelivered},
		{"crash_window", c.crashWindow},
		{"crash_inside", c.crashInside},
		{"concurrent", c.concurrent},
		{"out_of_order", c.outOfOrder},
		{"shuffled", c.shuffled},
		{"foreign_context", c.foreignContext},
		{"expired_record", c.expiredRecord},
	} {
		aggs := c.messages(sc.name)
		if err := sc.run(ctx, sc.name, aggs); err != nil {
			return c.report, fmt.Errorf("inboxcheck: %s: %w", sc.name, err)
		}
		if sc.name == "crash_inside" {
			continue // verified after each crash point
		}
		if err := c.verify(ctx, sc.name, aggs, ""); err != nil {
			return c.report, fmt.Errorf("inboxcheck: %s: %w", sc.name, err)
		}
	}
	return c.report, nil
}

// Monitor returns the command monitor the client of the checked database
// must have: through it the check counts a handler's database commands and
// interrupts the handler after its k-th (crash_inside). Set it when the
// client is made:
//
//	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetMonitor(inboxcheck.Monitor(nil)))
//
// next, if not nil, receives every event too (a monitor of your own). The
// monitor acts only on commands whose context the check marked; for the
// rest it only passes the events on.
func Monitor(next *event.CommandMonitor) *event.CommandMonitor {
	var m event.CommandMonitor
	if next != nil {
		m = *next
	}
	started, succeeded, failed := m.Started, m.Succeeded, m.Failed
	m.Started = func(ctx context.Context, e *event.CommandStartedEvent) {
		if started != nil {
			started(ctx, e)
		}
	}
	m.Succeeded = func(ctx context.Context, e *event.CommandSucceededEvent) {
		if p, ok := ctx.Value(pointKey{}).(*crashPoint); ok {
			p.done()
		}
		if succeeded != nil {
			succeeded(ctx, e)
		}
	}
	m.Failed = func(ctx context.Context, e *event.CommandFailedEvent) {
		if p, ok := ctx.Value(pointKey{}).(*crashPoint); ok {
			p.done()
		}
		if failed != nil {
			failed(ctx, e)
		}
	}
	return &m
}

// pointKey marks the context of the commands a crashPoint counts.
type pointKey struct{}

// crashPoint counts the commands made with its context, and cancels that
// context once after commands have completed (0: never): the driver sends
// no command on a cancelled context, so the handler's later commands never
// reach the server, as if the consumer had died there.
type crashPoint struct {
	after  int
	cancel context.CancelFunc

	mu    sync.Mutex
	count int
	fired bool
}

func (p *crashPoint) done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.count++
	if p.after > 0 && p.count == p.after {
		p.fired = true
		p.cancel()
	}
}

// state returns how many commands completed and whether the point fired.
func (p *crashPoint) state() (int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.count, p.fired
}

// counting returns ctx marked for a crash point after commands (0: count
// only), and the point.
func counting(ctx context.Context, after int) (context.Context, *crashPoint) {
	ctx, cancel := context.WithCancel(ctx)
	p := &crashPoint{after: after, cancel: cancel}
	return context.WithValue(ctx, pointKey{}, p), p
}

// monitored reports whether db's client has the check's Monitor: a ping
// made with a counting context must be counted.
func monitored(ctx context.Context, db *mongo.Database) (bool, error) {
	pctx, p := counting(ctx, 0)
	defer p.cancel()
	if err := db.RunCommand(pctx, bson.D{{Key: "ping", Value: 1}}).Err(); err != nil {
		return false, fmt.Errorf("inboxcheck: ping: %w", err)
	}
	n, _ := p.state()
	return n > 0, nil
}

// Probe sizes: probeWorkers goroutines each make probeUpdates $inc updates
// of one document, for up to probeRounds rounds until one loses an update.
const (
	probeWorkers = 4
	probeUpdates = 25
	probeRounds  = 3
)

// capabilities finds what the server under the check cannot show and
// lists the scenarios concerned in the report's Unchecked.
func (c *checker) capabilities(ctx context.Context) error {
	if c.report.Mode != inbox.ModeTransaction {
		c.unchecked("crash_window", fmt.Sprintf("no transactions in %s mode (a server without them, or Subject.Inbox.Mode): "+
			"that the handler's writes roll back with an aborted transaction is checked only in %s mode, on a replica set", c.report.Mode, inbox.ModeTransaction))
		c.unchecked("expired_record", fmt.Sprintf("no transactions in %s mode: that the handler reads before it writes "+
			"(a duplicate key inside a transaction aborts it) and returns every write error is checked only in %s mode, on a replica set", c.report.Mode, inbox.ModeTransaction))
	}
	if c.report.Mode == inbox.ModeTransaction {
		// Concurrent duplicates meet in the record's write conflict, not in
		// the handler: the server's update atomicity plays no part.
		return nil
	}
	lost, acked, err := c.probeAtomicUpdates(ctx)
	if err != nil {
		return err
	}
	if lost > 0 {
		c.unchecked("concurrent", fmt.Sprintf("concurrent updates of one document are not atomic here (a probe lost %d of %d acknowledged $inc updates), "+
			"so two concurrent runs of a handler that both update one document can show as one run: an effect applied twice may be reported as once; "+
			"an effect that adds a document per run is still checked", lost, acked))
	}
	return nil
}

// probeAtomicUpdates makes concurrent $inc updates of one document, in a
// collection of the run's own dropped afterwards, and returns how many of
// the acknowledged ones the document lost.
func (c *checker) probeAtomicUpdates(ctx context.Context) (lost, acked int, err error) {
	coll := c.db.Collection(strings.ReplaceAll(c.run, "-", "_") + "_probe")
	defer func() {
		if derr := coll.Drop(context.WithoutCancel(ctx)); derr != nil && err == nil {
			err = fmt.Errorf("inboxcheck: drop the probe's collection: %w", derr)
		}
	}()
	for round := range probeRounds {
		id := fmt.Sprintf("round-%d", round)
		if _, err := coll.InsertOne(ctx, bson.D{{Key: "_id", Value: id}, {Key: "n", Value: 0}}); err != nil {
			return 0, 0, fmt.Errorf("inboxcheck: the atomicity probe: %w", err)
		}
		var (
			wg   sync.WaitGroup
			oks  [probeWorkers]int
			errs [probeWorkers]error
		)
		for w := range probeWorkers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range probeUpdates {
					r, err := coll.UpdateOne(ctx, bson.D{{Key: "_id", Value: id}}, bson.D{{Key: "$inc", Value: bson.D{{Key: "n", Value: 1}}}})
					if err != nil {
						errs[w] = err
						return
					}
					oks[w] += int(r.ModifiedCount)
				}
			}()
		}
		wg.Wait()
		if err := errors.Join(errs[:]...); err != nil {
			return 0, 0, fmt.Errorf("inboxcheck: the atomicity probe: %w", err)
		}
		var doc struct {
			N int `bson:"n"`
		}
		if err := coll.FindOne(ctx, bson.D{{Key: "_id", Value: id}}).Decode(&doc); err != nil {
			return 0, 0, fmt.Errorf("inboxcheck: the atomicity probe: %w", err)
		}
		acked = 0
		for _, n := range oks {
			acked += n
		}
		if doc.N < acked {
			return acked - doc.N, acked, nil
		}
	}
	return 0, acked, nil
}

// checker is one run of Check.
type checker struct {
	db     *mongo.Database
	s      Subject
	run    string
	report *Report
	mu     sync.Mutex      // guards report, gaveUp and gates
	gaveUp map[string]bool // messages never acknowledged, by id
	gates  map[*inbox.Inbox]Gate
}

// fate says whether the message with id was acknowledged.
func (c *checker) fate(id string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gaveUp[id] {
		return "was never acknowledged"
	}
	return "was acknowledged (the inbox records it done)"
}

// errCrash and errProbe end deliveries on purpose.
var (
	errCrash       = errors.New("inboxcheck: the consumer died after the effect, before the record")
	errCrashInside = errors.New("inboxcheck: the consumer died inside the handler")
	errProbe       = errors.New("inboxcheck: probe delivery with a cancelled context")
)

func (c *checker) find(scenario, aggregateID, problem, format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.report.Findings = append(c.report.Findings, Finding{Scenario: scenario, AggregateID: aggregateID, Problem: problem, Detail: fmt.Sprintf(format, args...)})
}

func (c *checker) unchecked(scenario, reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.report.Unchecked = append(c.report.Unchecked, Unchecked{Scenario: scenario, Reason: reason})
}

// inbox returns an inbox of the subject's configuration for the consumer
// named after the run and name.
func (c *checker) inbox(name string) (*inbox.Inbox, error) {
	cfg := c.s.Inbox
	cfg.Consumer = c.run + "-" + name
	in, err := inbox.New(c.db, cfg)
	if err != nil {
		return nil, fmt.Errorf("inboxcheck: Subject.Inbox: %w", err)
	}
	return in, nil
}

// closing closes inboxes (those with Standalone.FlushInterval write what they buffer).
func closing(ctx context.Context, ins ...*inbox.Inbox) error {
	var errs []error
	for _, in := range ins {
		errs = append(errs, in.Close(ctx))
	}
	return errors.Join(errs...)
}

// messages returns the scenario's messages, by aggregate, in version order.
func (c *checker) messages(scenario string) [][]Message {
	out := make([][]Message, c.s.Aggregates)
	for a := range out {
		agg := fmt.Sprintf("%s-%s-%d", c.run, scenario, a+1)
		for v := int64(1); v <= int64(c.s.Versions); v++ {
			out[a] = append(out[a], Message{ID: fmt.Sprintf("%s-v%d", agg, v), AggregateID: agg, Version: v})
		}
	}
	return out
}

// wrapper changes the handler of one delivery; delivery counts from 1.
type wrapper func(m Message, delivery int, h inbox.Handler) inbox.Handler

// settle delivers queue through in until every message is acknowledged: a
// delivery that fails is delivered again after the others, as a broker
// requeues it, up to MaxDeliveries times. delivered, if set, is called
// after each delivery.
func (c *checker) settle(ctx context.Context, scenario string, in *inbox.Inbox, queue []Message, wrap wrapper, delivered func()) error {
	q := make([]copyOf, len(queue))
	for i, m := range queue {
		q[i] = copyOf{m, in}
	}
	return c.settleCopies(ctx, scenario, q, wrap, delivered)
}

// copyOf is a copy of a message, for the consumer instance in.
type copyOf struct {
	Message
	in *inbox.Inbox
}

// settleCopies is settle for copies each bound to its consumer instance.
func (c *checker) settleCopies(ctx context.Context, scenario string, queue []copyOf, wrap wrapper, delivered func()) error {
	deliveries := map[string]int{}
	for len(queue) > 0 {
		m := queue[0]
		queue = queue[1:]
		deliveries[m.ID]++
		err := c.deliver(ctx, m.in, m.Message, deliveries[m.ID], wrap)
		if delivered != nil {
			delivered()
		}
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, inbox.ErrInProgress):
			// Another consumer holds the message's claim: wait as a delay
			// queue would, without counting a delivery.
			deliveries[m.ID]--
			queue = append(queue, m)
			if err := pause(ctx); err != nil {
				return err
			}
		case deliveries[m.ID] >= c.s.MaxDeliveries:
			c.mu.Lock()
			c.gaveUp[m.ID] = true
			c.mu.Unlock()
			c.find(scenario, m.AggregateID, NeverAcknowledged, "message %s (version %d): %d deliveries failed, the last with: %v",
				m.ID, m.Version, deliveries[m.ID], err)
		default:
			queue = append(queue, m)
		}
	}
	return nil
}

// deliver makes one delivery of m through in.
func (c *checker) deliver(ctx context.Context, in *inbox.Inbox, m Message, delivery int, wrap wrapper) error {
	h := c.s.Handler(m)
	if h == nil {
		return fmt.Errorf("Subject.Handler returned nil for message %s", m.ID)
	}
	if wrap != nil {
		h = wrap(m, delivery, h)
	}
	c.mu.Lock()
	c.report.Deliveries++
	c.mu.Unlock()
	if c.s.Gate == nil {
		_, err := in.Process(ctx, m.ID, h)
		return err
	}
	g, err := c.gate(in)
	if err != nil {
		return err
	}
	_, err = g.Process(ctx, m.ID, inbox.Position{Aggregate: m.AggregateID, Version: m.Version}, h)
	return err
}

// gate returns Subject.Gate's gate for in, made on first use.
func (c *checker) gate(in *inbox.Inbox) (Gate, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if g, ok := c.gates[in]; ok {
		return g, nil
	}
	g, err := c.s.Gate(in)
	switch {
	case err != nil:
		return nil, fmt.Errorf("inboxcheck: Subject.Gate: %w", err)
	case g == nil:
		return nil, errors.New("inboxcheck: Subject.Gate returned nil")
	}
	c.gates[in] = g
	return g, nil
}

func pause(ctx context.Context) error {
	t := time.NewTimer(5 * time.Millisecond)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func flatten(aggs [][]Message) []Message {
	var out []Message
	for _, a := range aggs {
		out = append(out, a...)
	}
	return out
}

func (c *checker) redelivered(ctx context.Context, scenario string, aggs [][]Message) error {
	first, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	second, err := c.inbox(scenario) // the same consumer, another instance
	if err != nil {
		return err
	}
	for _, m := range flatten(aggs) {
		if err := c.settle(ctx, scenario, first, []Message{m}, nil, nil); err != nil {
			return err
		}
		if err := c.settle(ctx, scenario, second, []Message{m}, nil, nil); err != nil {
			return err
		}
	}
	return closing(ctx, first, second)
}

func (c *checker) crashWindow(ctx context.Context, scenario string, aggs [][]Message) error {
	in, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	crash := func(m Message, delivery int, h inbox.Handler) inbox.Handler {
		if delivery > 1 {
			return h
		}
		return func(ctx context.Context) error {
			if err := h(ctx); err != nil {
				return err
			}
			return errCrash
		}
	}
	for _, m := range flatten(aggs) {
		if err := c.settle(ctx, scenario, in, []Message{m}, crash, nil); err != nil {
			return err
		}
	}
	return closing(ctx, in)
}

// maxCrashPoint bounds the crash points crash_inside tries: a handler
// making more database commands per message is interrupted only after its
// first maxCrashPoint.
const maxCrashPoint = 50

// crashInside interrupts the handler after its k-th database command, for
// k = 1, 2, ... until no handler makes k commands: for each k, fresh
// aggregates, each message's first delivery interrupted there (its context
// cancelled, so none of its later commands reaches the server, and the
// delivery failed whatever the handler returns), then delivered again until
// acknowledged. A handler whose redelivery takes a partial effect for a
// whole one (a "done" marker of its own written before the effect) loses
// the effect, and verify reports it.
func (c *checker) crashInside(ctx context.Context, scenario string, _ [][]Message) error {
	in, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	for k := 1; ; k++ {
		if k > maxCrashPoint {
			c.unchecked(scenario, fmt.Sprintf("the handler makes more than %d database commands for one message; crashes after the later ones were not tried", maxCrashPoint))
			break
		}
		var (
			mu    sync.Mutex
			fired int
		)
		crash := func(m Message, delivery int, h inbox.Handler) inbox.Handler {
			if delivery > 1 {
				return h
			}
			return func(ctx context.Context) error {
				hctx, p := counting(ctx, k)
				defer p.cancel()
				err := h(hctx)
				if _, ok := p.state(); ok {
					mu.Lock()
					fired++
					mu.Unlock()
					return fmt.Errorf("%w (after the handler's database command %d)", errCrashInside, k)
				}
				return err
			}
		}
		aggs := c.messages(fmt.Sprintf("%s-k%d", scenario, k))
		for _, m := range flatten(aggs) {
			if err := c.settle(ctx, scenario, in, []Message{m}, crash, nil); err != nil {
				return err
			}
		}
		note := fmt.Sprintf(" (each message's first delivery interrupted after the handler's database command %d)", k)
		if err := c.verify(ctx, scenario, aggs, note); err != nil {
			return err
		}
		c.mu.Lock()
		c.report.Crashes += fired
		c.mu.Unlock()
		if fired == 0 {
			break
		}
	}
	return closing(ctx, in)
}

func (c *checker) concurrent(ctx context.Context, scenario string, aggs [][]Message) error {
	a, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	b, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	// In ModeTransaction the second transaction waits on the first's record
	// (a write conflict, retried) and never enters the handler meanwhile:
	// making them meet there would only wait.
	meet := c.report.Mode != inbox.ModeTransaction
	for _, m := range flatten(aggs) {
		var (
			mu       sync.Mutex
			arrived  int
			both     = make(chan struct{}) // both handlers are running
			returned = make(chan struct{}) // a delivery ended (a claim refused, a record found...)
			once     sync.Once
		)
		gate := func(m Message, delivery int, h inbox.Handler) inbox.Handler {
			if !meet {
				return h
			}
			return func(ctx context.Context) error {
				mu.Lock()
				if arrived++; arrived == 2 {
					close(both)
				}
				mu.Unlock()
				select {
				case <-both:
				case <-returned:
				case <-ctx.Done():
				}
				return h(ctx)
			}
		}
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i, in := range []*inbox.Inbox{a, b} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = c.settle(ctx, scenario, in, []Message{m}, gate, func() { once.Do(func() { close(returned) }) })
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
	}
	return closing(ctx, a, b)
}

func (c *checker) outOfOrder(ctx context.Context, scenario string, aggs [][]Message) error {
	in, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	var queue []Message
	for _, a := range aggs {
		reversed := slices.Clone(a)
		slices.Reverse(reversed)
		queue = append(queue, reversed...)
	}
	if err := c.settle(ctx, scenario, in, queue, nil, nil); err != nil {
		return err
	}
	return closing(ctx, in)
}

// shuffled delivers each aggregate's versions in swapped pairs, each
// delivery twice in a row, the second to another consumer instance.
func (c *checker) shuffled(ctx context.Context, scenario string, aggs [][]Message) error {
	a, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	b, err := c.inbox(scenario) // the same consumer, another instance
	if err != nil {
		return err
	}
	var queue []copyOf
	for _, agg := range aggs {
		for i := 0; i < len(agg); i += 2 {
			pair := agg[i:min(i+2, len(agg))]
			for j := len(pair) - 1; j >= 0; j-- {
				queue = append(queue, copyOf{pair[j], a}, copyOf{pair[j], b})
			}
		}
	}
	if err := c.settleCopies(ctx, scenario, queue, nil, nil); err != nil {
		return err
	}
	return closing(ctx, a, b)
}

func (c *checker) foreignContext(ctx context.Context, scenario string, aggs [][]Message) error {
	in, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	probe := func(m Message, delivery int, h inbox.Handler) inbox.Handler {
		return func(ctx context.Context) error {
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			_ = h(cctx)
			return errProbe
		}
	}
	for _, m := range flatten(aggs) {
		_ = c.deliver(ctx, in, m, 1, probe) // fails: errProbe
		if err := ctx.Err(); err != nil {
			return err
		}
		applied, err := c.s.Applied(ctx, m.AggregateID)
		if err != nil {
			return fmt.Errorf("Subject.Applied(%s): %w", m.AggregateID, err)
		}
		if slices.Contains(applied, m.ID) {
			c.find(scenario, m.AggregateID, ForeignContext,
				"message %s (version %d): its effect was applied by a delivery whose handler got a cancelled context: the handler does its database work with another context (in ModeTransaction such writes commit outside the transaction, even when it aborts)",
				m.ID, m.Version)
		}
		if err := c.settle(ctx, scenario, in, []Message{m}, nil, nil); err != nil {
			return err
		}
	}
	return closing(ctx, in)
}

func (c *checker) expiredRecord(ctx context.Context, scenario string, aggs [][]Message) error {
	first, err := c.inbox(scenario)
	if err != nil {
		return err
	}
	if err := c.settle(ctx, scenario, first, flatten(aggs), nil, nil); err != nil {
		return err
	}
	if err := closing(ctx, first); err != nil {
		return err
	}
	// Another consumer name: no record of any of the messages.
	again, err := c.inbox(scenario + "-expired")
	if err != nil {
		return err
	}
	if err := c.settle(ctx, scenario, again, flatten(aggs), nil, nil); err != nil {
		return err
	}
	return closing(ctx, again)
}

// verify wants each aggregate's effect to show its messages once each, in
// version order unless the subject is order-insensitive. note ends the
// details of the findings.
func (c *checker) verify(ctx context.Context, scenario string, aggs [][]Message, note string) error {
	for _, a := range aggs {
		agg := a[0].AggregateID
		got, err := c.s.Applied(ctx, agg)
		if err != nil {
			return fmt.Errorf("Subject.Applied(%s): %w", agg, err)
		}
		want := make([]string, len(a))
		version := map[string]int64{}
		for i, m := range a {
			want[i], version[m.ID] = m.ID, m.Version
		}
		counts := map[string]int{}
		for _, id := range got {
			counts[id]++
		}
		clean := true
		for _, m := range a {
			switch n := counts[m.ID]; {
			case n == 0:
				clean = false
				c.find(scenario, agg, Lost, "message %s (version %d) %s, and its effect is not there; effects: %v%s", m.ID, m.Version, c.fate(m.ID), got, note)
			case n > 1:
				clean = false
				c.find(scenario, agg, AppliedTwice, "message %s (version %d) applied %d times; effects: %v%s", m.ID, m.Version, n, got, note)
			}
		}
		for id := range counts {
			if _, ok := version[id]; !ok {
				clean = false
				c.find(scenario, agg, Unexpected, "the aggregate shows message %s, which was not delivered to it; effects: %v%s", id, got, note)
			}
		}
		if clean && !c.s.OrderInsensitive && !slices.Equal(got, want) {
			c.find(scenario, agg, OutOfOrder, "effects applied in the order %v, want %v%s", got, want, note)
		}
	}
	return nil
}

package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// e2e_rate_sweep: the highest order rate each relay mode sustains with the
// e2e p99 within the goal, against the same sweep of raw publish-and-consume.
// Each stage drives its rate in an open loop (orders arrive on schedule
// whether earlier ones finished or not, and each latency counts from the
// order's due time); the next stage's rate is sweepFactor times this one's.
// A mode stops at the first stage that breaks the p99 or cannot sustain its
// rate.

const (
	// sweepFactor is the step from one stage's rate to the next.
	sweepFactor = 1.5
	// sweepP99 is the p99 a stage must keep, e2e_latency's goal.
	sweepP99 = 25 * time.Millisecond
	// sweepMaxInFlight is the unfinished orders at which a stage's rate
	// counts as not sustained.
	sweepMaxInFlight = 1000
)

// sweepRates returns the rates of n stages from start, each sweepFactor
// times the one before, rounded to whole orders per second.
func sweepRates(start, n int) []int {
	rates := make([]int, 0, n)
	r := float64(start)
	for range n {
		rates = append(rates, int(math.Round(r)))
		r *= sweepFactor
	}
	return rates
}

// sweepStage is one stage of a sweep: its rate and what it measured.
type sweepStage struct {
	Rate int `json:"rate_per_s"`
	// Issued is the orders the open loop started; Saturated says it stopped
	// early with sweepMaxInFlight unfinished.
	Issued    int  `json:"issued"`
	Saturated bool `json:"saturated"`
	// Late is the orders not through within the drain wait: they count
	// with their latency at the deadline.
	Late       int                `json:"late"`
	P50ms      float64            `json:"p50_ms"`
	P99ms      float64            `json:"p99_ms"`
	MaxMs      float64            `json:"max_ms"`
	Load1Start *float64           `json:"load1_start,omitempty"`
	Load1End   *float64           `json:"load1_end,omitempty"`
	CPU        map[string]float64 `json:"cpu_per_order,omitempty"`
	Passed     bool               `json:"passed"`

	p99 time.Duration
}

// judge fills Passed: every order issued and through in time, p99 within
// the limit.
func (s *sweepStage) judge(limit time.Duration) {
	s.Passed = s.Issued > 0 && !s.Saturated && s.Late == 0 && s.p99 <= limit
}

// maxSustained is the rate of the last stage passed before the first that
// failed (0 when the first failed); capped says every stage passed, so the
// rate is a lower bound.
func maxSustained(stages []sweepStage) (rate int, capped bool) {
	for _, s := range stages {
		if !s.Passed {
			return rate, false
		}
		rate = s.Rate
	}
	return rate, len(stages) > 0
}

// openLoop calls fn perSecond times a second for d, each call in a goroutine
// of its own at its due time, whether earlier calls returned or not. With
// maxInFlight calls unreturned it stops issuing and reports saturated: the
// rate is not sustained. It waits for the calls issued and returns their
// number and the first error.
func openLoop(ctx context.Context, perSecond int, d time.Duration, maxInFlight int, fn func(ctx context.Context, i int, due time.Time) error) (issued int, saturated bool, err error) {
	return pacedLoop(ctx, perSecond, d, maxInFlight, false, fn)
}

// pacedLoop is openLoop and paced: with maxInFlight calls unreturned it
// waits for one to return (waitWhenFull) or stops and reports saturated.
func pacedLoop(ctx context.Context, perSecond int, d time.Duration, maxInFlight int, waitWhenFull bool, fn func(ctx context.Context, i int, due time.Time) error) (issued int, saturated bool, err error) {
	if perSecond <= 0 {
		return 0, false, fmt.Errorf("rate %d: want a positive rate", perSecond)
	}
	interval := time.Second / time.Duration(perSecond)
	slots := make(chan struct{}, maxInFlight)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	start := time.Now()
	for ; ; issued++ {
		due := start.Add(time.Duration(issued) * interval)
		if due.Sub(start) >= d {
			break
		}
		if wait := time.Until(due); wait > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(wait):
			}
		}
		if ctx.Err() != nil {
			break
		}
		if waitWhenFull {
			select {
			case slots <- struct{}{}:
			case <-ctx.Done():
			}
			if ctx.Err() != nil {
				break
			}
		} else {
			select {
			case slots <- struct{}{}:
			default:
				saturated = true
			}
			if saturated {
				break
			}
		}
		i := issued
		wg.Go(func() {
			defer func() { <-slots }()
			if err := fn(ctx, i, due); err != nil {
				mu.Lock()
				first = cmp.Or(first, err)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if first == nil && ctx.Err() != nil {
		first = ctx.Err()
	}
	return issued, saturated, first
}

// sweep runs stage at each rate of the sweep until one fails.
func (b *bench) sweep(ctx context.Context, name string, stage func(ctx context.Context, rate int) (sweepStage, error)) ([]sweepStage, error) {
	var stages []sweepStage
	for _, rate := range sweepRates(b.cfg.sweepStartRate, b.cfg.sweepStages) {
		loadStart := load1()
		s, err := stage(ctx, rate)
		if err != nil {
			return stages, fmt.Errorf("%s at %d/s: %w", name, rate, err)
		}
		s.Rate, s.Load1Start, s.Load1End = rate, loadStart, load1()
		s.judge(sweepP99)
		b.log.Info("e2e_rate_sweep stage", "mode", name, "rate", rate, "p99_ms", s.P99ms, "late", s.Late,
			"saturated", s.Saturated, "passed", s.Passed)
		stages = append(stages, s)
		if !s.Passed {
			break
		}
	}
	return stages, nil
}

// summarizeStage fills a stage's latencies from the due times and arrival
// times of its orders; an order not arrived counts at deadline.
func summarizeStage(s *sweepStage, due map[string]time.Time, arrived map[string]time.Time, deadline time.Time) error {
	lat := make([]time.Duration, 0, len(due))
	for id, d := range due {
		at, ok := arrived[id]
		if !ok {
			s.Late++
			at = deadline
		}
		lat = append(lat, at.Sub(d))
	}
	l, err := summarize(lat)
	if err != nil {
		return err
	}
	s.p99 = l.P99
	s.P50ms, s.P99ms, s.MaxMs = round(ms(l.P50)), round(ms(l.P99)), round(ms(l.Max))
	return nil
}

// dueTimes records the due time of each order of a stage.
type dueTimes struct {
	mu  sync.Mutex
	due map[string]time.Time
}

func (d *dueTimes) add(id string, at time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.due[id] = at
}

// sweepMode is a relay mode of e2e_latency's harness run at a sweep's rates:
// the real shipping process, on a vhost and a Mongo database of its own.
func (b *bench) sweepMode(ctx context.Context, bin, tmp string, poolCfg *pgxpool.Config, pool *pgxpool.Pool, v e2eVariant) ([]sweepStage, error) {
	url, err := b.env.newVhost(ctx, "sweep-"+v.name)
	if err != nil {
		return nil, err
	}
	ferretURI, ferretPID, err := b.ferretProcess(ctx) // apart, as in e2e_latency
	if err != nil {
		return nil, err
	}
	db, mongoURI, err := b.env.newMongoDatabaseAt(ctx, ferretURI, "sweep_"+v.name, 10)
	if err != nil {
		return nil, err
	}
	stopShipping, pid, err := b.startShipping(ctx, bin, url, strings.TrimSuffix(mongoURI, "/")+"/"+db.Name(),
		filepath.Join(tmp, "shipping-sweep-"+v.name+".log"))
	if err != nil {
		return nil, err
	}
	defer stopShipping() //nolint:errcheck // also stopped, and reported, by the run's close
	cfg, wcfg := b.relayConfig(), outbox.WriterConfig{}
	if v.notify {
		cfg.NotifyChannel, wcfg.NotifyChannel = notifyChannel, notifyChannel
	}
	writer, err := outbox.NewWriter(wcfg)
	if err != nil {
		return nil, err
	}
	var relay *runningRelay
	if v.wal {
		relay, err = b.startWALRelay(ctx, poolCfg, url, b.walSlotName("sweep_"+v.name))
	} else {
		relay, err = startRelay(ctx, poolCfg, url, cfg, nil)
	}
	if err != nil {
		return nil, err
	}
	defer relay.stop()
	events := db.Collection(shippingEventsCollection)
	meter := newCPUMeter(ctx, pool, url, "")
	meter.shippingPID = pid
	meter.mongoPID = ferretPID

	run := func(ctx context.Context, rate int, d time.Duration, label string) (sweepStage, error) {
		var s sweepStage
		dt := &dueTimes{due: map[string]time.Time{}}
		iv, err := meter.start(ctx, label)
		if err != nil {
			return s, err
		}
		s.Issued, s.Saturated, err = openLoop(ctx, rate, d, sweepMaxInFlight, func(ctx context.Context, i int, due time.Time) error {
			id, _, err := createOrder(ctx, pool, writer, i)
			if err != nil {
				return err
			}
			if v.wake {
				relay.relay.Wake()
			}
			dt.add(id+"/1", due)
			return nil
		})
		use, cpuErr := iv.stop(ctx, len(dt.due))
		if err = errors.Join(err, cpuErr); err != nil {
			return s, err
		}
		s.CPU = use.perEvent()
		applied, deadline, err := b.waitApplied(ctx, events, dt.due)
		if err != nil {
			return s, err
		}
		// applied_at is a BSON date, truncated to the millisecond: rounded
		// up, each latency is an upper bound.
		for id, at := range applied {
			applied[id] = at.Add(time.Millisecond)
		}
		return s, summarizeStage(&s, dt.due, applied, deadline)
	}
	// The warm-up also gives the LISTEN connection time to come up.
	if _, err := run(ctx, b.cfg.sweepStartRate, b.cfg.e2eWarmup, "sweep_"+v.name+"_warmup"); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	return b.sweep(ctx, v.name, func(ctx context.Context, rate int) (sweepStage, error) {
		return run(ctx, rate, b.cfg.sweepStage, fmt.Sprintf("sweep_%s_%d", v.name, rate))
	})
}

// waitApplied polls the shipment events until every order of want (by
// shipment _id) is applied or e2eDrainWait passed, then removes them, so
// that each poll of the next stage reads that stage's alone. It returns
// when each was applied, and when the wait ended.
func (b *bench) waitApplied(ctx context.Context, events *mongo.Collection, want map[string]time.Time) (map[string]time.Time, time.Time, error) {
	applied := map[string]time.Time{}
	deadline := time.Now().Add(b.cfg.e2eDrainWait)
	for len(applied) < len(want) && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return nil, time.Time{}, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
		cur, err := events.Find(ctx, bson.D{}, options.Find().SetProjection(bson.D{{Key: "applied_at", Value: 1}}))
		if err != nil {
			return nil, time.Time{}, fmt.Errorf("read shipments: %w", err)
		}
		var docs []struct {
			ID        string    `bson:"_id"`
			AppliedAt time.Time `bson:"applied_at"`
		}
		if err := cur.All(ctx, &docs); err != nil {
			return nil, time.Time{}, fmt.Errorf("read shipments: %w", err)
		}
		for _, d := range docs {
			if _, ok := want[d.ID]; ok {
				applied[d.ID] = d.AppliedAt
			}
		}
	}
	ended := time.Now()
	if _, err := events.DeleteMany(ctx, bson.D{}); err != nil {
		return nil, time.Time{}, fmt.Errorf("clear shipments: %w", err)
	}
	return applied, ended, nil
}

// sweepQueue is the raw baseline's queue.
const sweepQueue = "bench.sweep"

// sweepRaw is the baseline: the same order.created messages published with
// amqp091-go (persistent, each publish awaiting its confirm) to the same
// exchange, and consumed from a quorum queue by a consumer acknowledging
// each, as shipping's prefetch of 32: no database, no outbox, no inbox.
func (b *bench) sweepRaw(ctx context.Context) ([]sweepStage, error) {
	url, err := b.env.newVhost(ctx, "sweep-raw")
	if err != nil {
		return nil, err
	}
	pubConn, err := amqp.Dial(url)
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	defer pubConn.Close()
	subConn, err := amqp.Dial(url)
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	defer subConn.Close()
	sub, err := subConn.Channel()
	if err != nil {
		return nil, err
	}
	if err := sub.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return nil, err
	}
	if _, err := sub.QueueDeclare(sweepQueue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		return nil, err
	}
	if err := sub.QueueBind(sweepQueue, "order.*", exchange, false, nil); err != nil {
		return nil, err
	}
	if err := sub.Qos(32, 0, false); err != nil {
		return nil, err
	}
	deliveries, err := sub.Consume(sweepQueue, "bench-sweep", false, true, false, false, nil)
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	arrived := map[string]time.Time{}
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		for d := range deliveries {
			now := time.Now()
			mu.Lock()
			arrived[d.MessageId] = now
			mu.Unlock()
			_ = d.Ack(false)
		}
	}()
	defer func() {
		_ = subConn.Close()
		<-consumed
	}()
	// Publishers: channels in confirm mode, shared round robin (a channel
	// publishes one message at a time).
	const channels = 4
	pubs := make([]*amqp.Channel, channels)
	for i := range pubs {
		if pubs[i], err = pubConn.Channel(); err != nil {
			return nil, err
		}
		if err := pubs[i].Confirm(false); err != nil {
			return nil, err
		}
	}
	run := func(ctx context.Context, rate int, d time.Duration) (sweepStage, error) {
		var s sweepStage
		var err error
		dt := &dueTimes{due: map[string]time.Time{}}
		s.Issued, s.Saturated, err = openLoop(ctx, rate, d, sweepMaxInFlight, func(ctx context.Context, i int, due time.Time) error {
			msg, err := rawOrderMessage(i)
			if err != nil {
				return err
			}
			dt.add(msg.MessageId, due)
			dc, err := pubs[i%channels].PublishWithDeferredConfirmWithContext(ctx, exchange, eventCreated, false, false, msg)
			if err != nil {
				return fmt.Errorf("publish: %w", err)
			}
			if ok, err := dc.WaitContext(ctx); err != nil || !ok {
				return fmt.Errorf("publish not confirmed (%v)", err)
			}
			return nil
		})
		if err != nil {
			return s, err
		}
		deadline := time.Now().Add(b.cfg.e2eDrainWait)
		for time.Now().Before(deadline) {
			mu.Lock()
			n := 0
			for id := range dt.due {
				if _, ok := arrived[id]; ok {
					n++
				}
			}
			mu.Unlock()
			if n == len(dt.due) {
				break
			}
			select {
			case <-ctx.Done():
				return s, ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
		}
		ended := time.Now()
		mu.Lock()
		got := make(map[string]time.Time, len(dt.due))
		for id := range dt.due {
			if at, ok := arrived[id]; ok {
				got[id] = at
			}
		}
		clear(arrived)
		mu.Unlock()
		return s, summarizeStage(&s, dt.due, got, ended)
	}
	if _, err := run(ctx, b.cfg.sweepStartRate, b.cfg.e2eWarmup); err != nil {
		return nil, fmt.Errorf("warm-up: %w", err)
	}
	return b.sweep(ctx, "raw", func(ctx context.Context, rate int) (sweepStage, error) {
		return run(ctx, rate, b.cfg.sweepStage)
	})
}

// rawOrderMessage is an order.created message as the relay publishes it,
// its MessageId a new order's id.
func rawOrderMessage(n int) (amqp.Publishing, error) {
	id := newUUID()
	payload, err := json.Marshal(createdPayload{
		OrderID: id, CustomerID: fmt.Sprintf("c-%d", n%1000), Currency: "EUR", Items: benchItems, Total: 2500,
		CreatedAt: time.Now().UTC().Truncate(time.Microsecond),
	})
	if err != nil {
		return amqp.Publishing{}, err
	}
	return amqp.Publishing{
		MessageId: id, Type: eventCreated, ContentType: "application/json", DeliveryMode: amqp.Persistent,
		Timestamp: time.Now(), Headers: amqp.Table{"aggregate_id": id, "aggregate_type": aggregateType}, Body: payload,
	}, nil
}

// runE2ERateSweep measures e2e_rate_sweep: the raw baseline's sweep, then
// each relay mode's (e2e_latency's wake and notify, e2e_latency_wal's WAL).
func (b *bench) runE2ERateSweep(ctx context.Context) ([]Figure, error) {
	tmp, err := os.MkdirTemp("", "bench-sweep-")
	if err != nil {
		return nil, err
	}
	b.env.onClose("sweep temp dir "+tmp, func(context.Context) error { return os.RemoveAll(tmp) })
	bin, err := b.buildShipping(ctx, tmp)
	if err != nil {
		return nil, err
	}
	poolCfg, pool, err := b.env.openDatabase(ctx, "sweep", b.migrateOrders)
	if err != nil {
		return nil, err
	}
	defer pool.Close()

	details := map[string]any{
		"start_rate_per_s": b.cfg.sweepStartRate, "factor": sweepFactor, "stage_seconds": b.cfg.sweepStage.Seconds(),
		"max_stages": b.cfg.sweepStages, "p99_limit_ms": ms(sweepP99), "max_in_flight": sweepMaxInFlight,
		"drain_wait_seconds": b.cfg.e2eDrainWait.Seconds(), "relay_config": b.relayConfigText(),
	}
	raw, err := b.sweepRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("raw: %w", err)
	}
	rawRate, rawCapped := maxSustained(raw)
	details["raw"] = map[string]any{"stages": raw, "max_rate_per_s": rawRate, "reached_the_last_stage": rawCapped}

	modes := []e2eVariant{{name: "wake", wake: true}, {name: "notify", notify: true}, {name: "wal", wal: true}}
	figs := make([]Figure, 0, len(modes))
	for _, v := range modes {
		stages, err := b.sweepMode(ctx, bin, tmp, poolCfg, pool, v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.name, err)
		}
		rate, capped := maxSustained(stages)
		d := map[string]any{"stages": stages, "reached_the_last_stage": capped}
		if len(figs) == 0 {
			d["sweep"] = details
		}
		figs = append(figs, newFigure("e2e_rate_sweep_"+v.name, "orders/s", float64(rate), float64(rawRate), Goal{RatioAtLeast, 0.5},
			fmt.Sprintf("the highest order rate, in an open-loop sweep from %d/s by x%.1f, whose e2e p99 (due time to shipment applied) stays <= %v, relay mode %s",
				b.cfg.sweepStartRate, sweepFactor, sweepP99, v.name),
			"the same sweep of raw publish-and-consume (amqp091-go, confirms, a quorum queue): no database, outbox or inbox", d))
	}
	return figs, nil
}

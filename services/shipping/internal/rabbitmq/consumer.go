package rabbitmq

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"maps"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/services/shipping/internal/amqpaddr"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Handler decides what happens to each delivery. It is called from several
// goroutines at once.
type Handler interface {
	Handle(ctx context.Context, d shipment.Delivery) shipment.Verdict
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, d shipment.Delivery) shipment.Verdict

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, d shipment.Delivery) shipment.Verdict {
	return f(ctx, d)
}

// Config configures a Consumer.
type Config struct {
	// URL is the broker's AMQP URL; its path is the vhost. Required. For a
	// cluster it lists the nodes' URLs separated by commas: each connection
	// tries them in turn, starting after the node it last connected to, so a
	// connection lost with its node moves to another one (amqpaddr).
	URL string
	// Topology names the exchanges and queues (defaults in Topology).
	Topology Topology
	// Prefetch is the channel's QoS prefetch count. Default: 32.
	Prefetch int
	// Concurrency is how many deliveries are handled at once. Default: 8.
	// Each worker has a lane: the deliveries of one order (the
	// aggregate_id header, or the CloudEvents subject) all go to one lane
	// (Lane), in delivery order, so that one process never handles two
	// versions of an order at once (the later one would find a gap and wait
	// through the delay queue). A delivery that names no order goes to the
	// first free worker. A delivery a worker is stuck on holds up the rest
	// of its lane.
	Concurrency int
	// ReconnectMin and ReconnectMax bound the exponential backoff between
	// connection attempts. Default: 100ms and 5s.
	ReconnectMin, ReconnectMax time.Duration
	// RetryMin and RetryMax bound the backoff before a Retry verdict's
	// delivery is handled again. Default: 100ms and 5s.
	RetryMin, RetryMax time.Duration
	// ConfirmTimeout bounds the wait for the broker's confirm of a deferred
	// or dead-lettered copy, not counting the time the broker blocks the
	// publishing connection (a memory or disk alarm; see Run). Past it (the
	// delay queue has no leader) the delivery is handed back to the queue
	// (nack with requeue, which counts against its delivery limit) and the
	// worker moves on, so that the deliveries that need only an ack keep
	// flowing. Default: 30s.
	ConfirmTimeout time.Duration
	// StuckAfter is how long a worker may handle one delivery (its handler,
	// the retries of a Retry verdict, the settling) before it counts as
	// stuck; while every worker is stuck, Working fails (the service's
	// /readyz answers 503). Default: 60s, as long as the server's default
	// transactionLifetimeLimitSeconds.
	StuckAfter time.Duration
	// ShutdownTimeout is how long in-flight deliveries may finish after the
	// context ends (or after the broker cancelled the consumer, or returned a
	// republished copy); then their handling is cancelled and they return to
	// the queue. Default: 10s.
	ShutdownTimeout time.Duration
	// ConnectionName is shown in the broker's management tools; the
	// connection that publishes deferred and dead-lettered copies is
	// ConnectionName+"-publisher". Default: "shipping".
	ConnectionName string
	// Metrics, when set, counts deferrals, dead letters and connections.
	Metrics *metrics.Metrics
	// Logger receives the consumer's logs. Default: discard.
	Logger *slog.Logger
	// TracerProvider starts a span per delivery ("process <exchange>", kind
	// CONSUMER) linked to the context in the delivery's headers (its
	// creation's), and its child while the event is younger than
	// ParentMaxAge, with child spans for the republished copies (PRODUCER)
	// and the ack. Default: a no-op provider (no spans; the delivery's trace
	// context and baggage still reach the handler and the copies).
	TracerProvider trace.TracerProvider
	// ParentMaxAge is how old an event (its outbox_created_at header) may be
	// for its process span to be a child of the context it carries; an
	// older one is processed in a trace of its own, linked to that context.
	// Default: DefaultParentMaxAge (30s); negative: never a child.
	ParentMaxAge time.Duration
	// Propagator reads and writes trace context and baggage in the headers.
	// Default: W3C Trace Context and Baggage.
	Propagator propagation.TextMapPropagator
}

// Consumer consumes Topology.Queue and applies the Handler's verdicts.
type Consumer struct {
	cfg     Config
	nodes   *amqpaddr.Nodes // the consuming connection's; the republisher forks them
	h       Handler
	log     *slog.Logger
	ready   atomic.Bool
	tagBase string
	tr      tracing
	// busy holds, per worker, when it took its current delivery (Unix
	// nanoseconds), 0 while it waits for one.
	busy []atomic.Int64
}

// New returns a Consumer; Run starts it.
func New(cfg Config, h Handler) (*Consumer, error) {
	if cfg.URL == "" {
		return nil, errors.New("rabbitmq: URL is required")
	}
	nodes, err := amqpaddr.New(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: URL: %w", err)
	}
	if h == nil {
		return nil, errors.New("rabbitmq: nil handler")
	}
	cfg.Topology = cfg.Topology.WithDefaults()
	if err := cfg.Topology.validate(); err != nil {
		return nil, err
	}
	cfg.Prefetch = cmp.Or(cfg.Prefetch, 32)
	cfg.Concurrency = cmp.Or(cfg.Concurrency, 8)
	cfg.ReconnectMin = cmp.Or(cfg.ReconnectMin, 100*time.Millisecond)
	cfg.ReconnectMax = cmp.Or(cfg.ReconnectMax, 5*time.Second)
	cfg.RetryMin = cmp.Or(cfg.RetryMin, 100*time.Millisecond)
	cfg.RetryMax = cmp.Or(cfg.RetryMax, 5*time.Second)
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, 10*time.Second)
	cfg.StuckAfter = cmp.Or(cfg.StuckAfter, DefaultStuckAfter)
	cfg.ConfirmTimeout = cmp.Or(cfg.ConfirmTimeout, DefaultConfirmTimeout)
	cfg.ConnectionName = cmp.Or(cfg.ConnectionName, "shipping")
	switch {
	case cfg.Prefetch < 1 || cfg.Prefetch > 65535:
		return nil, fmt.Errorf("rabbitmq: Prefetch %d: want 1..65535", cfg.Prefetch)
	case cfg.Concurrency < 1:
		return nil, fmt.Errorf("rabbitmq: Concurrency %d: want at least 1", cfg.Concurrency)
	case cfg.ReconnectMin <= 0 || cfg.ReconnectMax < cfg.ReconnectMin:
		return nil, fmt.Errorf("rabbitmq: reconnect backoff %v..%v: want 0 < min <= max", cfg.ReconnectMin, cfg.ReconnectMax)
	case cfg.RetryMin <= 0 || cfg.RetryMax < cfg.RetryMin:
		return nil, fmt.Errorf("rabbitmq: retry backoff %v..%v: want 0 < min <= max", cfg.RetryMin, cfg.RetryMax)
	case cfg.ShutdownTimeout < 0:
		return nil, fmt.Errorf("rabbitmq: ShutdownTimeout %v: want >= 0", cfg.ShutdownTimeout)
	case cfg.StuckAfter < 0:
		return nil, fmt.Errorf("rabbitmq: StuckAfter %v: want > 0", cfg.StuckAfter)
	case cfg.ConfirmTimeout < 0:
		return nil, fmt.Errorf("rabbitmq: ConfirmTimeout %v: want > 0", cfg.ConfirmTimeout)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Consumer{
		cfg: cfg, nodes: nodes, h: h, log: log, tagBase: cfg.ConnectionName + "-" + hex.EncodeToString(randBytes(4)),
		tr:   newTracing(cfg.TracerProvider, cfg.Propagator, cfg.Topology.Queue, cfg.ParentMaxAge),
		busy: make([]atomic.Int64, cfg.Concurrency),
	}, nil
}

// Defaults of Config.
const (
	DefaultStuckAfter     = 60 * time.Second
	DefaultConfirmTimeout = 30 * time.Second
)

// Working returns nil unless every worker has been handling one delivery
// for longer than StuckAfter: a handler that never returns, a dependency
// that keeps failing under a Retry verdict, a settling that never ends. The
// consumer then takes no new delivery.
func (c *Consumer) Working() error {
	now := time.Now()
	var latest time.Time
	for i := range c.busy {
		ns := c.busy[i].Load()
		if ns == 0 {
			return nil
		}
		since := time.Unix(0, ns)
		if now.Sub(since) <= c.cfg.StuckAfter {
			return nil
		}
		if since.After(latest) {
			latest = since
		}
	}
	return fmt.Errorf("all %d workers stuck: each has been on one delivery for more than %v (the latest for %v)",
		len(c.busy), c.cfg.StuckAfter, now.Sub(latest).Round(time.Second))
}

// Topology returns the topology with defaults filled in.
func (c *Consumer) Topology() Topology { return c.cfg.Topology }

// Ready returns nil while the consumer is connected and consuming.
func (c *Consumer) Ready() error {
	if c.ready.Load() {
		return nil
	}
	return errors.New("not consuming from the broker")
}

// Run connects, declares the topology, and consumes until ctx ends,
// reconnecting with backoff whenever the connection or a channel is lost,
// the broker cancels the consumer (its queue was deleted), or a republished
// copy cannot be routed because its queue or exchange is gone: each new
// session declares the topology again. On ctx's end it stops taking
// deliveries, lets in-flight ones finish (within ShutdownTimeout) and
// returns nil.
//
// Deferred and dead-lettered copies are published on a connection of their
// own (named ConnectionName+"-publisher"), kept across sessions: RabbitMQ
// blocks connections that publish under a memory or disk alarm, and the
// consuming connection, which carries the acks, must not be one of them.
// While the publishing connection is blocked, a delivery whose copy waits
// for it is left unacked to a goroutine of its own, which settles it once
// the connection is unblocked, and its worker goes on with the next
// delivery; the prefetch bounds how many wait. At the session's end they
// stop waiting, and their deliveries return to the queue.
func (c *Consumer) Run(ctx context.Context) error {
	pub := &republisher{
		nodes: c.nodes.Fork(), name: c.cfg.ConnectionName + "-publisher",
		inFlight: c.cfg.Prefetch + c.cfg.Concurrency, timeout: c.cfg.ConfirmTimeout,
		log: c.log, metrics: c.cfg.Metrics,
	}
	defer pub.close()
	failures := 0
	for {
		connected, err := c.session(ctx, pub)
		if ctx.Err() != nil {
			return nil
		}
		// A session that ended because the topology was gone backs off
		// further each time, in case redeclaring does not cure it.
		if connected && !errors.Is(err, errTopologyLost) {
			failures = 0
		}
		delay := backoff(c.cfg.ReconnectMin, c.cfg.ReconnectMax, failures)
		failures++
		c.log.WarnContext(ctx, "broker session ended, reconnecting", "error", err, "attempt", failures, "backoff", delay)
		if !sleep(ctx, delay) {
			return nil
		}
	}
}

// errTopologyLost marks the session ends that a redeclaration cures: the
// broker cancelled the consumer, returned a republished copy, or had no
// exchange for it.
var errTopologyLost = errors.New("topology lost")

// dial connects to one of the nodes (amqpaddr.Nodes.Dial), the next after
// the one it last connected to, and returns the connection with the node's
// host:port.
func dial(nodes *amqpaddr.Nodes, name string) (*amqp.Connection, string, error) {
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(name)
	return nodes.Dial(amqp.Config{Properties: props, Heartbeat: 10 * time.Second})
}

// session runs one connection's lifetime. connected reports whether it got
// as far as consuming.
func (c *Consumer) session(ctx context.Context, pub *republisher) (connected bool, err error) {
	conn, node, err := dial(c.nodes, c.cfg.ConnectionName)
	if err != nil {
		return false, fmt.Errorf("dial: %w", err)
	}
	defer conn.Close()
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))

	ch, err := conn.Channel()
	if err != nil {
		return false, fmt.Errorf("open channel: %w", err)
	}
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	cancelled := ch.NotifyCancel(make(chan string, 1))
	if err := c.cfg.Topology.Declare(ch); err != nil {
		return false, err
	}
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return false, fmt.Errorf("set prefetch: %w", err)
	}
	tag := c.tagBase + "-" + hex.EncodeToString(randBytes(4))
	deliveries, err := ch.Consume(c.cfg.Topology.Queue, tag, false, false, false, false, nil)
	if err != nil {
		return false, fmt.Errorf("consume %s: %w", c.cfg.Topology.Queue, err)
	}

	c.ready.Store(true)
	defer c.ready.Store(false)
	m := c.cfg.Metrics
	if m != nil {
		m.BrokerConnections.Inc()
		m.Consuming.Set(1)
		defer m.Consuming.Set(0)
	}
	c.log.InfoContext(ctx, "consuming", "queue", c.cfg.Topology.Queue, "prefetch", c.cfg.Prefetch, "concurrency", c.cfg.Concurrency)

	// Handling outlives ctx (in-flight deliveries finish on shutdown) but not
	// the connection: once it is lost, no delivery of it can be acked.
	hctx, hcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer hcancel()
	// Deliveries waiting for the publishing connection stop waiting as the
	// session ends.
	wctx, wcancel := context.WithCancel(hctx)
	defer wcancel()
	s := &sessionState{
		ch: ch, pub: pub, server: serverAttrs(node), waitCtx: wctx,
		lost: make(chan struct{}), draining: make(chan struct{}), ended: make(chan struct{}),
	}

	lanes := make([]chan amqp.Delivery, c.cfg.Concurrency)
	for i := range lanes {
		// At most Prefetch deliveries are unsettled at once: a lane of that
		// size never holds the dispatcher up. Past maxLaneBuffer (a prefetch
		// above it) a full lane holds every lane's dispatch until its worker
		// takes the next delivery.
		lanes[i] = make(chan amqp.Delivery, min(c.cfg.Prefetch, maxLaneBuffer))
	}
	anyLane := make(chan amqp.Delivery) // deliveries that name no order: the first free worker
	go func() {
		for d := range deliveries {
			if key := shipment.OrderKey(d.Headers); key != "" {
				lanes[Lane(key, len(lanes))] <- d
			} else {
				anyLane <- d
			}
		}
		// The broker cancelled the consumer (queue deleted), the channel
		// closed, or we cancelled it on shutdown.
		for _, l := range lanes {
			close(l)
		}
		close(anyLane)
	}()
	var wg sync.WaitGroup
	for i := range c.cfg.Concurrency {
		wg.Go(func() {
			own, shared := lanes[i], anyLane
			for own != nil || shared != nil {
				var d amqp.Delivery
				var ok bool
				select {
				case d, ok = <-own:
					if !ok {
						own = nil
						continue
					}
				case d, ok = <-shared:
					if !ok {
						shared = nil
						continue
					}
				}
				c.busy[i].Store(time.Now().UnixNano())
				c.handle(hctx, s, d)
				c.busy[i].Store(0)
			}
			s.end(fmt.Errorf("%w: deliveries channel closed", errTopologyLost))
		})
	}
	workersDone := make(chan struct{})
	go func() { wg.Wait(); close(workersDone) }()

	var cause error
	graceful := false
	select {
	case <-ctx.Done():
		graceful = true
	case e := <-connClosed:
		cause = fmt.Errorf("connection closed: %v", e)
	case e := <-chClosed:
		cause = fmt.Errorf("channel closed: %v", e)
	case <-s.ended:
		// The channel may still work: let in-flight deliveries finish.
		cause, graceful = s.endCause(), true
		// Name the real cause when the deliveries channel closed for one.
		select {
		case e := <-connClosed:
			cause, graceful = fmt.Errorf("connection closed: %v", e), false
		case e := <-chClosed:
			cause, graceful = fmt.Errorf("channel closed: %v", e), false
		case t := <-cancelled:
			cause = fmt.Errorf("%w: the broker cancelled consumer %s (queue %s deleted?)", errTopologyLost, t, c.cfg.Topology.Queue)
		default:
		}
	}
	c.ready.Store(false)
	if m != nil {
		m.Consuming.Set(0)
	}
	if graceful {
		// Stop deliveries, let in-flight ones finish, then close: what was
		// prefetched but not started returns to the queue.
		close(s.draining)
		wcancel()
		_ = ch.Cancel(tag, false)
		timer := time.NewTimer(c.cfg.ShutdownTimeout)
		select {
		case <-workersDone:
		case <-timer.C:
			c.log.WarnContext(ctx, "timeout: cancelling in-flight deliveries; they return to the queue")
		}
		timer.Stop()
	}
	// Deliveries not settled by now are redelivered by the broker: stop
	// handling them and never ack them.
	close(s.lost)
	wcancel()
	hcancel()
	_ = conn.Close()
	<-workersDone
	s.waiters.Wait()
	if ctx.Err() != nil {
		c.log.InfoContext(ctx, "consumer stopped")
		return true, nil
	}
	return true, cause
}

// maxLaneBuffer caps a lane's buffer.
const maxLaneBuffer = 256

// Lane returns which of n workers handles the deliveries of the order key
// (shipment.OrderKey): always the same one, so that one process handles an
// order's deliveries one at a time and in delivery order.
func Lane(key string, n int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

// sessionState is what workers share within one connection.
type sessionState struct {
	ch       *amqp.Channel
	pub      *republisher
	server   []attribute.KeyValue // server.address and server.port of the node, for the spans
	lost     chan struct{}        // closed when the connection is gone or closing
	draining chan struct{}        // closed when the session ends: take no new delivery, stop retrying
	// waitCtx ends with the session: the deliveries waiting for the
	// publishing connection (in waiters) stop waiting.
	waitCtx context.Context
	waiters sync.WaitGroup // the goroutines settling deliveries with a copy to publish

	endOnce sync.Once
	ended   chan struct{} // closed by end
	cause   error
}

// end asks the session to end (the first cause wins).
func (s *sessionState) end(cause error) {
	s.endOnce.Do(func() {
		s.cause = cause
		close(s.ended)
	})
}

// endCause is end's cause, once ended is closed.
func (s *sessionState) endCause() error { return s.cause }

func (s *sessionState) isLost() bool {
	select {
	case <-s.lost:
		return true
	default:
		return false
	}
}

func (c *Consumer) handle(ctx context.Context, s *sessionState, d amqp.Delivery) {
	select {
	case <-s.draining:
		return // the session ends: leave it unacked, it returns to the queue
	default:
	}
	if mutantShippingAckFirst {
		_ = d.Ack(false) // a planted bug: see mutant_shipping_ackfirst.go
	}
	del := shipment.Delivery{
		MessageID: d.MessageId, Type: d.Type, ContentType: d.ContentType, Exchange: d.Exchange, RoutingKey: d.RoutingKey,
		Headers: d.Headers, Body: d.Body, Redelivered: d.Redelivered,
	}
	// The handler's context carries the delivery's trace context and
	// baggage, and its process span.
	dctx := c.tr.extract(ctx, &d)
	for attempt := 0; ; attempt++ {
		hctx, span := c.tr.startProcess(dctx, &d, attempt, s.server)
		v := c.h.Handle(hctx, del)
		if s.isLost() {
			endProcess(span, v, errors.New("connection lost before the delivery was settled; the broker delivers it again"))
			return
		}
		if v.Action == shipment.Retry {
			endProcess(span, v, nil)
		} else {
			waiting, err := c.settleOrWait(hctx, s, d, v, span)
			if waiting {
				return
			}
			endProcess(span, v, err)
			if c.settled(ctx, s, d, v, err) {
				return
			}
			c.log.WarnContext(ctx, "could not settle delivery, will handle it again",
				"event_id", d.MessageId, "action", v.Action.String(), "error", err, "attempt", attempt+1)
		}
		// Keep the delivery (no ack, no requeue) and try again later.
		delay := backoff(c.cfg.RetryMin, c.cfg.RetryMax, attempt)
		t := time.NewTimer(delay)
		select {
		case <-s.lost:
			t.Stop()
			return
		case <-s.draining:
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// settled reports whether d is done with after its settling returned err:
// settled, handed back to the queue (its copy not confirmed in time), or
// left to a new session (its copy's queue or exchange gone).
func (c *Consumer) settled(ctx context.Context, s *sessionState, d amqp.Delivery, v shipment.Verdict, err error) bool {
	switch {
	case err == nil:
		return true
	case errors.Is(err, errConfirmTimeout):
		// Hand the delivery back and free the worker: waiting on, every
		// worker would end up here and no ack would flow.
		c.log.WarnContext(ctx, "republished copy not confirmed in time; returning the delivery to the queue",
			"event_id", d.MessageId, "action", v.Action.String(), "error", err)
		if m := c.cfg.Metrics; m != nil {
			m.RepublishTimeouts.Inc()
		}
		c.handBack(ctx, s, d)
		return true
	case errors.Is(err, ErrReturned) || errors.Is(err, errNoExchange):
		// Its queue or exchange is gone: a new session redeclares it, and
		// the delivery, unacked, comes again.
		c.log.WarnContext(ctx, "republished copy not routed; ending the session to redeclare the topology",
			"event_id", d.MessageId, "action", v.Action.String(), "error", err)
		s.end(fmt.Errorf("%w: %w", errTopologyLost, err))
		return true
	}
	return false
}

// handBack returns d to the queue (nack with requeue).
func (c *Consumer) handBack(ctx context.Context, s *sessionState, d amqp.Delivery) {
	if s.isLost() || mutantShippingAckFirst {
		return
	}
	if err := d.Nack(false, true); err != nil {
		c.log.WarnContext(ctx, "nack", "event_id", d.MessageId, "error", err)
	}
}

// settleOrWait settles d under v. A verdict with a copy to publish (Defer,
// DeadLetter) is settled on a goroutine of its own, which the worker waits
// for unless the publishing connection is or gets blocked (a resource
// alarm): then that goroutine waits for the connection on its own, d
// unacked, and the worker moves on (waiting is true). It settles d once the
// connection is unblocked, or stops waiting when the session ends.
func (c *Consumer) settleOrWait(ctx context.Context, s *sessionState, d amqp.Delivery, v shipment.Verdict, span trace.Span) (waiting bool, err error) {
	if v.Action != shipment.Defer && v.Action != shipment.DeadLetter {
		return false, c.settle(ctx, s, d, v)
	}
	sctx, cancel := context.WithCancel(ctx)
	result, waits := make(chan error), make(chan struct{})
	var stopWaiting func() bool
	s.waiters.Go(func() {
		err := c.settle(sctx, s, d, v)
		select {
		case result <- err: // the worker waited
		case <-waits:
			stopWaiting()
			cancel()
			c.waited(ctx, s, d, v, span, err)
		}
	})
	for {
		blocked, changed := s.pub.blockState()
		if blocked {
			break
		}
		select {
		case err := <-result:
			cancel()
			return false, err
		case <-changed:
		}
	}
	stopWaiting = context.AfterFunc(s.waitCtx, cancel)
	close(waits)
	c.log.InfoContext(ctx, "publishing connection blocked: the delivery waits for it unacked, its worker moves on",
		"event_id", d.MessageId, "action", v.Action.String())
	return true, nil
}

// waited finishes a delivery whose settling waited for the publishing
// connection, off its worker: err is the settling's.
func (c *Consumer) waited(ctx context.Context, s *sessionState, d amqp.Delivery, v shipment.Verdict, span trace.Span, err error) {
	endProcess(span, v, err)
	switch {
	case err == nil:
		c.log.InfoContext(ctx, "delivery settled after waiting for the publishing connection",
			"event_id", d.MessageId, "action", v.Action.String())
	case s.waitCtx.Err() != nil:
		c.log.InfoContext(ctx, "session ended while the delivery waited for the publishing connection; it returns to the queue",
			"event_id", d.MessageId, "action", v.Action.String(), "error", err)
	case c.settled(ctx, s, d, v, err):
	default:
		// A worker handles it again.
		c.log.WarnContext(ctx, "could not settle delivery after waiting for the publishing connection; returning it to the queue",
			"event_id", d.MessageId, "action", v.Action.String(), "error", err)
		c.handBack(ctx, s, d)
	}
}

// settle carries out a verdict. Republished copies are confirmed before the
// original is acked, so a message is never only in flight.
func (c *Consumer) settle(ctx context.Context, s *sessionState, d amqp.Delivery, v shipment.Verdict) error {
	switch v.Action {
	case shipment.Ack:
	case shipment.Defer:
		msg := c.copyOf(d, v.Headers)
		if err := republish(ctx, &c.tr, s.pub, "", c.cfg.Topology.DelayQueue, v.Reason, msg); err != nil {
			return fmt.Errorf("defer to %s: %w", c.cfg.Topology.DelayQueue, err)
		}
		if m := c.cfg.Metrics; m != nil {
			m.Deferred.WithLabelValues(v.Reason).Inc()
		}
	case shipment.DeadLetter:
		h := maps.Clone(v.Headers)
		if h == nil {
			h = map[string]any{}
		}
		h[shipment.HeaderReason] = v.Reason
		h[shipment.HeaderError] = truncate(v.Detail, 1024)
		h[shipment.HeaderDeadLetteredBy] = c.cfg.ConnectionName
		msg := c.copyOf(d, h)
		if err := republish(ctx, &c.tr, s.pub, c.cfg.Topology.DeadLetterExchange, d.RoutingKey, v.Reason, msg); err != nil {
			return fmt.Errorf("dead-letter to %s: %w", c.cfg.Topology.DeadLetterExchange, err)
		}
		if m := c.cfg.Metrics; m != nil {
			m.DeadLettered.WithLabelValues(v.Reason).Inc()
		}
		c.log.WarnContext(ctx, "message dead-lettered", "event_id", d.MessageId, "reason", v.Reason, "error", v.Detail)
	default:
		return fmt.Errorf("unknown action %v", v.Action)
	}
	if mutantShippingAckFirst {
		return nil // acknowledged as it arrived
	}
	// Acks go on the channel the delivery came from, never on a newer one.
	if s.isLost() {
		return errors.New("connection lost before ack")
	}
	if err := ack(ctx, &c.tr, &d); err != nil {
		return fmt.Errorf("ack: %w", err)
	}
	return nil
}

// republish publishes msg, a copy of a delivery, to exchange with key,
// under its publish span (a child of the process span in ctx).
func republish(ctx context.Context, tr *tracing, pub *republisher, exchange, key, reason string, msg amqp.Publishing) error {
	pctx, span := tr.startPublish(ctx, exchange, key, reason, &msg)
	err := pub.publish(pctx, exchange, key, msg)
	endSpan(span, err)
	return err
}

// ack acks d under its ack span (a child of the process span in ctx).
func ack(ctx context.Context, tr *tracing, d *amqp.Delivery) error {
	span := tr.startAck(ctx, d)
	err := d.Ack(false)
	endSpan(span, err)
	return err
}

// copyOf is the message to republish for d, with extra headers set.
func (c *Consumer) copyOf(d amqp.Delivery, extra map[string]any) amqp.Publishing {
	h := amqp.Table{}
	for k, v := range d.Headers {
		switch k {
		case "x-delivery-count", headerPublishSeq:
		default:
			h[k] = v
		}
	}
	if _, ok := h[shipment.HeaderOriginalExchange]; !ok {
		h[shipment.HeaderOriginalExchange] = d.Exchange
		h[shipment.HeaderOriginalRoutingKey] = d.RoutingKey
	}
	for k, v := range extra {
		h[k] = v
	}
	return amqp.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// backoff is min doubled n times, capped at max, with jitter in [d/2, d].
func backoff(minD, maxD time.Duration, n int) time.Duration {
	d := minD
	for range min(n, 30) {
		d *= 2
		if d >= maxD {
			d = maxD
			break
		}
	}
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = crand.Read(b)
	return b
}

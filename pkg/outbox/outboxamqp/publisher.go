package outboxamqp

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/redial"
)

// Config configures a Publisher. The zero value of every optional field means
// its default.
type Config struct {
	// URL is the broker, e.g. amqp://guest:guest@127.0.0.1:5672/vhost.
	// Required. For a cluster it may list the nodes as URLs separated by
	// commas (amqp://u:p@node1:5672/v,amqp://u:p@node2:5672/v; a comma in a
	// password is written %2C): each connection attempt tries them in turn,
	// starting after the node of the last connection, so a lost connection
	// moves to another node. See ParseURLs.
	URL string
	// Exchange receives every message. It is declared (durable, not
	// auto-deleted) on every connection, so a broker that lost it gets it back;
	// declaring is idempotent, and fails (logged, retried) if the exchange exists
	// with another type. Required unless Queue is set: the default exchange
	// cannot be declared.
	Exchange string
	// Queue, when set, sends every message to this one queue and no other:
	// through the default exchange, with the queue's name as routing key
	// (Exchange, ExchangeType and RoutingKey must be unset). The queue is not
	// declared: a message to a queue that does not exist is returned, an
	// ErrUnroutable failure. For a replay to one new consumer (package
	// outboxbackfill), which the consumers bound to Exchange must not see.
	Queue string
	// ExchangeType is the type of Exchange. Default DefaultExchangeType.
	ExchangeType string
	// RoutingKey returns a message's routing key. Default: its event type.
	RoutingKey func(outbox.Envelope) string
	// ConnectionName is shown by the broker's management tools. Default
	// DefaultConnectionName.
	ConnectionName string
	// TLS configures amqps:// connections. Default: the system's roots.
	TLS *tls.Config
	// DialTimeout bounds the TCP connect and the AMQP handshake. Default
	// DefaultDialTimeout (5s).
	DialTimeout time.Duration
	// Heartbeat is the AMQP heartbeat interval, which detects a silent broker.
	// Default DefaultHeartbeat (10s).
	Heartbeat time.Duration
	// ReconnectMin and ReconnectMax bound the exponential backoff between
	// failed connection attempts (with random jitter down to half). Defaults
	// DefaultReconnectMin (100ms) and DefaultReconnectMax (10s).
	ReconnectMin time.Duration
	ReconnectMax time.Duration
	// MaxInFlight is how many messages one batch may have awaiting their
	// confirms at once: for a relay, its BatchSize (a larger value does no
	// harm). It sizes the buffer of each channel that takes the broker's
	// basic.return notifications, so the client never waits to hand one over
	// (it drops a notification not taken within 5s, and a dropped return
	// would count an unroutable message as published). The reader of that
	// buffer never blocks either, so a smaller value is still correct under
	// normal scheduling. Each slot takes 264 bytes (64-bit), allocated once
	// per channel. Default DefaultMaxInFlight (1,000).
	MaxInFlight int
	// Logger receives connection events. Default slog.Default().
	Logger *slog.Logger
	// CloudEvents, when set, publishes each event as a CloudEvents 1.0 event
	// in the binary content mode of the AMQP protocol binding: its
	// attributes in headers named cloudEvents_*, the payload as the body
	// (see the package documentation and CloudEventsPublishing). Default
	// nil: the outbox's own envelope (see Publishing).
	CloudEvents *CloudEvents
}

// Defaults of Config: the value a zero field means.
const (
	DefaultExchangeType   = amqp.ExchangeTopic
	DefaultConnectionName = "outbox-relay"
	DefaultDialTimeout    = 5 * time.Second
	DefaultHeartbeat      = 10 * time.Second
	DefaultReconnectMin   = 100 * time.Millisecond
	DefaultReconnectMax   = 10 * time.Second
	DefaultMaxInFlight    = 1000
)

// Publisher publishes outbox envelopes to RabbitMQ with publisher confirms. It
// implements outbox.Publisher; see that interface for the contract. It holds one
// connection, opened by WaitReady and reopened after it fails, and on it one
// confirm-mode channel per batch in flight (a relay's Workers), so that a
// fault on one batch's channel fails no other batch. It is safe for
// concurrent use.
type Publisher struct {
	cfg   Config
	urls  []string // the nodes, from Config.URL
	nodes []string // their host:port, for logs
	log   *slog.Logger
	conn  *redial.Conn[session] // the session, and the dialling of a new one
	next  int                   // the node the next dial tries first, under conn's dial lock

	frameSize int // the frame_max the client asks for; 0: amqp091's default, the broker's 128 KiB
}

// minFrameMax is the frame_max a message needs whose headers fill
// outbox.MaxHeaderBytes: the table, and the rest of the content header frame
// (frame header and end, class, weight, body size, property flags, content
// type, delivery mode, message id, timestamp, a type of 255 bytes: 324 bytes),
// rounded up.
const minFrameMax = outbox.MaxHeaderBytes + 512

var _ outbox.Publisher = (*Publisher)(nil)

// ErrClosed is returned by WaitReady after Close.
var ErrClosed = errors.New("outboxamqp: publisher closed")

// NewPublisher validates cfg and returns a Publisher. It does not connect: WaitReady
// does, so a broker that is down at start only delays publishing.
func NewPublisher(cfg Config) (*Publisher, error) {
	if cfg.URL == "" {
		return nil, errors.New("outboxamqp: URL is required")
	}
	urls, err := ParseURLs(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("outboxamqp: URL: %w", err)
	}
	nodes := make([]string, len(urls))
	vhost := ""
	for i, u := range urls {
		uri, _ := amqp.ParseURI(u) // checked by ParseURLs
		nodes[i] = net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port))
		vhost = uri.Vhost
	}
	switch {
	case cfg.Queue != "" && (cfg.Exchange != "" || cfg.ExchangeType != "" || cfg.RoutingKey != nil):
		return nil, errors.New("outboxamqp: Queue publishes through the default exchange: Exchange, ExchangeType and RoutingKey must be unset")
	case cfg.Queue != "":
		queue := cfg.Queue
		cfg.RoutingKey = func(outbox.Envelope) string { return queue }
	case cfg.Exchange == "":
		return nil, errors.New("outboxamqp: Exchange (or Queue) is required")
	}
	if cfg.MaxInFlight < 0 {
		return nil, errors.New("outboxamqp: MaxInFlight is negative")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"DialTimeout", cfg.DialTimeout}, {"Heartbeat", cfg.Heartbeat}, {"ReconnectMin", cfg.ReconnectMin}, {"ReconnectMax", cfg.ReconnectMax}} {
		if d.v < 0 {
			return nil, fmt.Errorf("outboxamqp: %s is negative", d.name)
		}
	}
	cfg.ExchangeType = cmp.Or(cfg.ExchangeType, DefaultExchangeType)
	if cfg.RoutingKey == nil {
		cfg.RoutingKey = func(e outbox.Envelope) string { return e.EventType }
	}
	cfg.ConnectionName = cmp.Or(cfg.ConnectionName, DefaultConnectionName)
	cfg.MaxInFlight = cmp.Or(cfg.MaxInFlight, DefaultMaxInFlight)
	cfg.DialTimeout = cmp.Or(cfg.DialTimeout, DefaultDialTimeout)
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, DefaultHeartbeat)
	cfg.ReconnectMin = cmp.Or(cfg.ReconnectMin, DefaultReconnectMin)
	cfg.ReconnectMax = cmp.Or(cfg.ReconnectMax, max(DefaultReconnectMax, cfg.ReconnectMin))
	if cfg.ReconnectMin > cfg.ReconnectMax {
		return nil, fmt.Errorf("outboxamqp: ReconnectMin %v exceeds ReconnectMax %v", cfg.ReconnectMin, cfg.ReconnectMax)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.CloudEvents != nil {
		ce := *cfg.CloudEvents // the caller's value may change after New
		if err := ce.Validate(); err != nil {
			return nil, err
		}
		cfg.CloudEvents = &ce
	}
	p := &Publisher{
		cfg:   cfg,
		urls:  urls,
		nodes: nodes,
		log: cfg.Logger.With(slog.String("broker", strings.Join(nodes, ",")),
			slog.String("vhost", vhost), slog.String("exchange", cfg.Exchange), slog.String("queue", cfg.Queue)),
	}
	p.conn = redial.New(redial.Config[session]{
		Name: "outboxamqp", Min: cfg.ReconnectMin, Max: cfg.ReconnectMax, Logger: p.log,
		Dial: p.dial, Dead: (*session).isDead, Cause: (*session).cause, Close: (*session).close,
		ErrClosed: ErrClosed, ErrNotConnected: ErrNotConnected,
	})
	return p, nil
}

// WaitReady returns nil once the publisher is connected and the broker is not
// blocking publishers (connection.blocked, e.g. on a memory alarm). It
// (re)connects with jittered exponential backoff, logging each failure, for as
// long as ctx lasts.
func (p *Publisher) WaitReady(ctx context.Context) error {
	for {
		s, err := p.conn.Session(ctx)
		if err != nil {
			return err
		}
		if s.waitUnblocked(ctx) == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// The session died while blocked: connect again.
	}
}

// ErrNotConnected is wrapped by Ready's error while the publisher has no live
// connection.
var ErrNotConnected = errors.New("outboxamqp: not connected to the broker")

// Ready reports, without dialling or waiting, whether the publisher can
// publish right now: nil when it holds a live connection and channel and the
// broker is not blocking publishers. Otherwise its error says why: not
// connected (wrapping ErrNotConnected, with the lost connection's cause and
// the last failed attempt's error), the broker's reason for blocking, or
// ErrClosed. It is meant for a readiness probe. After a connection is lost,
// Ready fails until a WaitReady call (the relay makes one before each claim)
// has connected again.
func (p *Publisher) Ready() error {
	s, err := p.conn.Ready()
	if err != nil {
		return err
	}
	if reason, blocked := s.blockedBy(); blocked {
		return fmt.Errorf("outboxamqp: the broker is blocking publishers: %s", reason)
	}
	return nil
}

// dial connects to one node: it tries each of them once, starting with
// p.next, and returns the first session that opens. The next dial starts
// after the node connected to, so a lost connection moves to another node. It
// runs under the dial lock of p.conn.
func (p *Publisher) dial(ctx context.Context) (*session, error) {
	var errs []error
	for range p.urls {
		i := p.next
		p.next = (p.next + 1) % len(p.urls)
		s, err := p.dialNode(ctx, i)
		if err == nil {
			s.node = p.nodes[i]
			if len(p.urls) > 1 {
				p.log.InfoContext(ctx, "outboxamqp: connected", slog.String("node", p.nodes[i]))
			}
			return s, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		if len(p.urls) > 1 {
			err = fmt.Errorf("%s: %w", p.nodes[i], err)
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

// dialNode connects to the i-th node, opens the confirm-mode channel and
// declares the exchange.
func (p *Publisher) dialNode(ctx context.Context, i int) (*session, error) {
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(p.cfg.ConnectionName)
	dialer := &net.Dialer{Timeout: p.cfg.DialTimeout}
	var w *wire
	conn, err := amqp.DialConfig(p.urls[i], amqp.Config{
		FrameSize:       p.frameSize,
		Heartbeat:       p.cfg.Heartbeat,
		TLSClientConfig: p.cfg.TLS,
		Properties:      props,
		Dial: func(network, addr string) (net.Conn, error) {
			c, err := dialer.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// Bounds the handshake; the client clears it once connected.
			if err := c.SetDeadline(time.Now().Add(p.cfg.DialTimeout)); err != nil {
				_ = c.Close()
				return nil, err
			}
			w = &wire{Conn: c}
			return w, nil
		},
	})
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	log := p.log
	if len(p.urls) > 1 {
		log = log.With(slog.String("node", p.nodes[i]))
	}
	if fs := conn.Config.FrameSize; fs > 0 && fs < minFrameMax {
		log.WarnContext(ctx, "outboxamqp: the connection's frame_max is smaller than what a message whose headers fill outbox.MaxHeaderBytes needs: the broker will refuse such messages, and the relay will isolate and dead-letter them; raise the broker's frame_max",
			slog.Int("frame_max", fs), slog.Int("needed", minFrameMax))
	}
	s := newSession(conn, w, log, p.cfg.MaxInFlight)
	c, err := s.openChannel()
	if err != nil {
		s.close()
		return nil, err
	}
	// With Queue, the default exchange: it always exists and cannot be declared.
	if p.cfg.Queue == "" {
		if err := c.ch.ExchangeDeclare(p.cfg.Exchange, p.cfg.ExchangeType, true, false, false, false, nil); err != nil {
			s.close()
			return nil, fmt.Errorf("declare exchange %q: %w", p.cfg.Exchange, err)
		}
	}
	s.release(c) // the first batch's channel
	return s, nil
}

// Nodes returns how many broker nodes Config.URL lists: the publisher
// dials them in turn (see ParseURLs).
func (p *Publisher) Nodes() int { return len(p.urls) }

// ParseURLs splits a Config.URL listing several nodes at its commas and
// checks each part as an AMQP URI (amqp:// or amqps://). Spaces around the
// parts are ignored; an empty part is an error. A single URL gives one
// element.
func ParseURLs(s string) ([]string, error) {
	var urls []string
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			return nil, fmt.Errorf("empty address in %d-address list", strings.Count(s, ",")+1)
		}
		if _, err := amqp.ParseURI(part); err != nil {
			return nil, fmt.Errorf("address %d: %w", len(urls)+1, err)
		}
		urls = append(urls, part)
	}
	return urls, nil
}

// PublishBatch publishes msgs on a channel of its own, all sent before any
// confirm is awaited, and returns one error per message: nil only for a
// message the broker confirmed and did not return. See outbox.Publisher.
//
// A fault of the batch's channel fails this batch only: after a nack, or
// confirms that did not come by ctx's deadline, the channel is closed and
// the next batch opens another, while batches on other channels go on. When
// the broker closed the channel (or the connection) because of a message it
// refuses (406 PRECONDITION_FAILED, 501 FRAME_ERROR, 502 SYNTAX_ERROR), it
// does not say which: every message of the batch still without a verdict
// gets an error wrapping outbox.ErrBatchRefused.
func (p *Publisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	return p.PublishBatchTimed(ctx, msgs, nil)
}

// PublishBatchTimed is PublishBatch that also sets confirmed[i] (when
// confirmed is not nil) to the time message i's confirm, positive or not,
// was seen, and leaves it zero when none was: a tracing decorator ends each
// message's span then (outboxotel.ConfirmTimer). Confirms are awaited in
// publish order, so one that arrives before an earlier message's is seen
// with it; RabbitMQ confirms mostly in order on a channel.
func (p *Publisher) PublishBatchTimed(ctx context.Context, msgs []outbox.Envelope, confirmed []time.Time) []error {
	if len(confirmed) != len(msgs) {
		confirmed = nil
	}
	errs := make([]error, len(msgs))
	s := p.conn.Load()
	if s == nil || s.isDead() {
		fill(errs, 0, fmt.Errorf("outboxamqp: not connected: %w", outbox.ErrNotSent))
		return errs
	}
	c, err := s.acquire()
	if err != nil {
		fill(errs, 0, fmt.Errorf("outboxamqp: %w: %w", err, outbox.ErrNotSent))
		return errs
	}
	defer s.release(c)

	flights := make([]*flight, len(msgs))
	for i, m := range msgs {
		flights[i] = &flight{id: m.MessageID()}
	}
	c.track(flights)
	defer c.untrack(flights)

	// Send everything first: many messages in flight, one confirm each.
	sent := c.send(ctx, p.cfg.Exchange, msgs, flights, p.cfg.RoutingKey, p.publishing, errs)

	// Then collect the verdicts.
	for i := range sent {
		f := flights[i]
		if f.dc == nil {
			continue // errs[i] set by send
		}
		select {
		case <-f.dc.Done():
			if confirmed != nil {
				confirmed[i] = time.Now()
			}
		case <-ctx.Done():
		}
	}
	timedOut := false
	for i := range sent {
		if f := flights[i]; f.dc != nil && !isDone(f.dc.Done()) {
			timedOut = true
		}
	}
	if _, blocked := s.blockedBy(); timedOut && blocked {
		// The broker blocks publishing (a resource alarm) and reads nothing
		// more: the close of the channel would go unanswered and take the
		// connection with it, and a new connection is not known to be
		// blocked until it publishes, so every batch claimed meanwhile would
		// time out too and cost each of its events an attempt, until the
		// alarm clears or MaxAttempts dead-letters them. The connection stays:
		// WaitReady waits on it for connection.unblocked. The channel takes
		// no other batch, and is closed once the broker unblocks.
		p.log.WarnContext(ctx, "outboxamqp: confirms timed out while the broker blocks publishing; the batch's channel is closed once it unblocks", slog.Any("error", ctx.Err()))
		c.retireUntilUnblocked()
	} else if timedOut {
		// Confirms stuck past the deadline: this channel is not trustworthy.
		// Closing it fails its other pending confirms; other batches' channels
		// go on.
		p.log.WarnContext(ctx, "outboxamqp: confirms timed out, closing the batch's channel", slog.Any("error", ctx.Err()))
		c.close()
	}
	// A basic.return precedes the ack of its message: have every return
	// received so far recorded before reading the acks. When the batch's
	// deadline has passed already, the check gets a short bound of its own.
	syncCtx := ctx
	if ctx.Err() != nil {
		var cancel context.CancelFunc
		syncCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
	}
	syncErr := c.syncReturns(syncCtx)

	nacked := false
	for i := range sent {
		f := flights[i]
		if f.dc == nil {
			continue
		}
		if !isDone(f.dc.Done()) {
			errs[i] = fmt.Errorf("outboxamqp: no confirm within the publish timeout (outcome unknown): %w", ctx.Err())
			continue
		}
		switch ret := f.returned.Load(); {
		case ret != nil:
			errs[i] = fmt.Errorf("outboxamqp: returned by the broker: %d %s (exchange %q, routing key %q): %w",
				ret.ReplyCode, ret.ReplyText, ret.Exchange, ret.RoutingKey, outbox.ErrUnroutable)
		case syncErr != nil && f.dc.Acked():
			errs[i] = fmt.Errorf("outboxamqp: confirmed, but its return could not be ruled out (outcome unknown): %w", syncErr)
		case f.dc.Acked():
			errs[i] = nil
		default:
			cause, closed := c.closeCause()
			switch {
			case closed && refusesAMessage(cause):
				errs[i] = fmt.Errorf("outboxamqp: the broker refused a message of this batch and closed its channel (outcome unknown): %w: %w",
					cause, outbox.ErrBatchRefused)
			case closed:
				errs[i] = fmt.Errorf("outboxamqp: channel or connection closed before the confirm (outcome unknown): %w", cause)
			default:
				errs[i] = errors.New("outboxamqp: nacked by the broker")
				nacked = true
			}
		}
	}
	// A channel that saw a nack is not used again: on RabbitMQ 3.10, a
	// channel that got a quorum queue's nack while the queue elected a new
	// leader went on nacking every publish to it (seen for minutes on a
	// three-node cluster), while a new channel was confirmed at once.
	if nacked {
		p.log.WarnContext(ctx, "outboxamqp: nacked by the broker, closing the batch's channel")
		c.close()
	}
	if n := c.strays.Swap(0); n > 0 {
		// Logged here, by a caller, never by the returns reader.
		p.log.WarnContext(ctx, "outboxamqp: returns for messages no longer awaited", slog.Int64("returns", n))
	}
	return errs
}

// refusesAMessage tells a channel or connection close with which the broker
// refuses a message it was sent (rather than failing for everyone): a header
// of a type it does not accept (406; RabbitMQ checks CC and BCC), a frame
// larger than frame_max (501), a field table it cannot parse (502). Only a
// close the broker sent counts: the client reports a broken connection as a
// 501 of its own.
func refusesAMessage(err error) bool {
	var e *amqp.Error
	if !errors.As(err, &e) || !e.Server {
		return false
	}
	switch e.Code {
	case amqp.PreconditionFailed, amqp.FrameError, amqp.SyntaxError:
		return true
	}
	return false
}

// Exchange returns the exchange every message is published to (Config.Exchange;
// "", the default exchange, with Config.Queue), e.g. for a tracing
// decorator's messaging.destination.name.
func (p *Publisher) Exchange() string { return p.cfg.Exchange }

// RoutingKey returns the routing key e is published with (Config.RoutingKey,
// by default its event type).
func (p *Publisher) RoutingKey(e outbox.Envelope) string { return p.cfg.RoutingKey(e) }

// Node returns the host and port of the broker node the publisher is
// connected to, or "" and 0 when it is not, e.g. for a tracing decorator's
// server.address and server.port (outboxotel.Server).
func (p *Publisher) Node() (host string, port int) {
	s := p.conn.Load()
	if s == nil || s.isDead() {
		return "", 0
	}
	host, ps, err := net.SplitHostPort(s.node)
	if err != nil {
		return "", 0
	}
	port, _ = strconv.Atoi(ps)
	return host, port
}

// Close closes the connection. Later WaitReady calls return ErrClosed. Batches
// in flight get their confirms reported as failed.
func (p *Publisher) Close() error {
	// Waits for a dial in progress, so its session is closed too.
	p.conn.Close(func(s *session) {
		s.close()
		s.wg.Wait()
	})
	return nil
}

// publishing returns the message for e in the envelope Config chooses.
func (p *Publisher) publishing(e outbox.Envelope) (amqp.Publishing, error) {
	if p.cfg.CloudEvents != nil {
		return p.cfg.CloudEvents.publishing(e)
	}
	return Publishing(e), nil
}

// HeaderCreatedAt carries the outbox row's creation time to the microsecond
// (RFC 3339, UTC): the Timestamp property holds whole seconds only, too
// coarse for a consumer that measures the time from commit to effect.
const HeaderCreatedAt = "outbox_created_at"

// Publishing returns the AMQP message the Publisher sends for e: persistent,
// JSON, MessageId e.MessageID(), Type the event type, Timestamp the outbox
// row's creation, and the headers aggregate_type, aggregate_id, event_type,
// aggregate_version and outbox_created_at over e's own headers. Use it to publish an envelope by
// other means (a replay tool, a benchmark's baseline) in exactly the same form.
func Publishing(e outbox.Envelope) amqp.Publishing {
	h := make(amqp.Table, len(e.Headers)+5)
	for k, v := range e.Headers {
		h[k] = v
	}
	// Set last: the outbox's own fields win over same-named free headers.
	h["aggregate_type"] = e.AggregateType
	h["aggregate_id"] = e.AggregateID
	h["event_type"] = e.EventType
	h["aggregate_version"] = e.AggregateVersion
	if !e.CreatedAt.IsZero() {
		h[HeaderCreatedAt] = e.CreatedAt.UTC().Format(time.RFC3339Nano)
	}
	return amqp.Publishing{
		Headers:      h,
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		MessageId:    e.MessageID(),
		Timestamp:    e.CreatedAt,
		Type:         e.EventType,
		Body:         e.Payload,
	}
}

func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func fill(errs []error, from int, err error) {
	for i := from; i < len(errs); i++ {
		errs[i] = err
	}
}

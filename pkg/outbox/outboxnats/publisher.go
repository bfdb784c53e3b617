package outboxnats

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/textproto"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/redial"
)

// Config configures a Publisher. The zero value of every optional field means
// its default.
type Config struct {
	// URL is the server, e.g. nats://127.0.0.1:4222; for a cluster, several
	// URLs separated by commas, tried in turn. Required.
	URL string
	// SubjectPrefix makes each message's subject SubjectPrefix + "." + its
	// event type, e.g. "orders.events.order.created". Required unless
	// Subject is set. A stream must capture the subjects (here
	// "orders.events.>"): a message no stream takes is unroutable.
	SubjectPrefix string
	// Subject returns a message's subject, in place of SubjectPrefix's.
	Subject func(outbox.Envelope) string
	// Name is the connection's name, shown by the server's monitoring.
	// Default "outbox-relay".
	Name string
	// Options are further nats.go options, e.g. credentials or TLS. The
	// Publisher's own (no reconnect by the client, no reconnect buffer, its
	// handlers, timeout, pings, name) come after them and win.
	Options []nats.Option
	// DialTimeout bounds a connection attempt. Default 5s.
	DialTimeout time.Duration
	// Heartbeat is the interval of the client's pings: two unanswered ones
	// end the connection. Default 10s.
	Heartbeat time.Duration
	// ReconnectMin and ReconnectMax bound the exponential backoff between
	// failed connection attempts (with random jitter down to half). Defaults
	// 100ms and 10s.
	ReconnectMin time.Duration
	ReconnectMax time.Duration
	// MaxInFlight is how many acknowledgements the connection may await at
	// once, all batches together; a publish beyond it waits for room until
	// its batch's deadline. Default 4,000.
	MaxInFlight int
	// AckTimeout is how long an acknowledgement that no batch awaits any
	// more (its deadline passed) is still expected before it is forgotten.
	// Default 1 minute.
	AckTimeout time.Duration
	// Logger receives connection events. Default slog.Default().
	Logger *slog.Logger
}

// Publisher publishes outbox envelopes to NATS JetStream, each
// acknowledged by the stream that stored it. It implements
// outbox.Publisher; see the package documentation. It is safe for
// concurrent use.
type Publisher struct {
	cfg  Config
	log  *slog.Logger
	conn *redial.Conn[session] // the session, and the dialling of a new one
}

var _ outbox.Publisher = (*Publisher)(nil)

var (
	// ErrClosed is returned by WaitReady and Ready after Close.
	ErrClosed = errors.New("outboxnats: publisher closed")
	// ErrNotConnected is wrapped by Ready's error while the publisher has no
	// live connection.
	ErrNotConnected = errors.New("outboxnats: not connected to the server")
)

// NewPublisher validates cfg and returns a Publisher. It does not connect:
// WaitReady does, so a server that is down at start only delays publishing.
func NewPublisher(cfg Config) (*Publisher, error) {
	if strings.TrimSpace(cfg.URL) == "" {
		return nil, errors.New("outboxnats: URL is required")
	}
	if cfg.Subject == nil {
		if err := checkSubject(cfg.SubjectPrefix + ".x"); err != nil || cfg.SubjectPrefix == "" {
			return nil, fmt.Errorf("outboxnats: SubjectPrefix %q: want one or more dot-separated tokens without wildcards or spaces (or set Subject)", cfg.SubjectPrefix)
		}
		prefix := cfg.SubjectPrefix + "."
		cfg.Subject = func(e outbox.Envelope) string { return prefix + e.EventType }
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"DialTimeout", cfg.DialTimeout}, {"Heartbeat", cfg.Heartbeat}, {"ReconnectMin", cfg.ReconnectMin}, {"ReconnectMax", cfg.ReconnectMax}, {"AckTimeout", cfg.AckTimeout}} {
		if d.v < 0 {
			return nil, fmt.Errorf("outboxnats: %s is negative", d.name)
		}
	}
	if cfg.MaxInFlight < 0 {
		return nil, errors.New("outboxnats: MaxInFlight is negative")
	}
	cfg.Name = cmp.Or(cfg.Name, "outbox-relay")
	cfg.DialTimeout = cmp.Or(cfg.DialTimeout, 5*time.Second)
	cfg.Heartbeat = cmp.Or(cfg.Heartbeat, 10*time.Second)
	cfg.ReconnectMin = cmp.Or(cfg.ReconnectMin, 100*time.Millisecond)
	cfg.ReconnectMax = cmp.Or(cfg.ReconnectMax, max(10*time.Second, cfg.ReconnectMin))
	if cfg.ReconnectMin > cfg.ReconnectMax {
		return nil, fmt.Errorf("outboxnats: ReconnectMin %v exceeds ReconnectMax %v", cfg.ReconnectMin, cfg.ReconnectMax)
	}
	cfg.MaxInFlight = cmp.Or(cfg.MaxInFlight, 4000)
	cfg.AckTimeout = cmp.Or(cfg.AckTimeout, time.Minute)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	p := &Publisher{cfg: cfg, log: cfg.Logger.With(slog.String("server", cfg.URL))}
	p.conn = redial.New(redial.Config[session]{
		Name: "outboxnats", Min: cfg.ReconnectMin, Max: cfg.ReconnectMax, Logger: p.log,
		Dial: p.dial, Dead: (*session).isDead, Cause: (*session).causeErr,
		Discard: (*session).closeConn, Close: (*session).closeConn,
		ErrClosed: ErrClosed, ErrNotConnected: ErrNotConnected,
	})
	return p, nil
}

// session is one connection and its JetStream context. The client does not
// reconnect it: a connection that ends ends the session, its
// acknowledgements still awaited fail, and WaitReady dials a new one.
type session struct {
	nc    *nats.Conn
	js    jetstream.JetStream
	lost  chan struct{} // closed once the connection is closed
	once  sync.Once
	cause atomic.Pointer[error]
}

func (s *session) markLost(err error) {
	if err != nil {
		s.cause.CompareAndSwap(nil, &err)
	}
	s.once.Do(func() { close(s.lost) })
}

func (s *session) isDead() bool {
	select {
	case <-s.lost:
		return true
	default:
		return !s.nc.IsConnected()
	}
}

// closeConn closes the connection; its handler then marks the session lost.
func (s *session) closeConn() { s.nc.Close() }

func (s *session) causeErr() error {
	if c := s.cause.Load(); c != nil {
		return *c
	}
	return errors.New("connection closed")
}

// WaitReady returns nil once the publisher is connected to a server with
// JetStream enabled. It (re)connects with jittered exponential backoff,
// logging each failure, for as long as ctx lasts.
func (p *Publisher) WaitReady(ctx context.Context) error {
	_, err := p.conn.Session(ctx)
	return err
}

// Ready reports, without dialling or waiting, whether the publisher holds a
// live connection: nil if so, otherwise an error wrapping ErrNotConnected
// (with the lost connection's cause and the last failed attempt's error) or
// ErrClosed. It is meant for a readiness probe.
func (p *Publisher) Ready() error {
	_, err := p.conn.Ready()
	return err
}

// ctxDialer dials within ctx, so that a WaitReady whose context ends does
// not wait for a connection attempt to time out.
type ctxDialer struct{ ctx context.Context }

func (d ctxDialer) Dial(network, address string) (net.Conn, error) {
	var nd net.Dialer
	return nd.DialContext(d.ctx, network, address)
}

// dial connects, and checks that the server runs JetStream.
func (p *Publisher) dial(ctx context.Context) (*session, error) {
	s := &session{lost: make(chan struct{})}
	dctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	defer cancel()
	opts := append([]nats.Option(nil), p.cfg.Options...)
	opts = append(opts,
		nats.Name(p.cfg.Name),
		nats.Timeout(p.cfg.DialTimeout),
		nats.SetCustomDialer(ctxDialer{ctx: dctx}),
		nats.NoReconnect(),
		nats.ReconnectBufSize(-1), // a publish without a connection fails at once: never sent
		nats.PingInterval(p.cfg.Heartbeat),
		nats.MaxPingsOutstanding(2),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) { s.markLost(err) }),
		nats.ClosedHandler(func(*nats.Conn) { s.markLost(nil) }),
	)
	nc, err := nats.Connect(p.cfg.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(p.cfg.MaxInFlight),
		jetstream.WithPublishAsyncTimeout(p.cfg.AckTimeout))
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	if _, err := js.AccountInfo(dctx); err != nil {
		nc.Close()
		return nil, fmt.Errorf("jetstream account info (is JetStream enabled?): %w", err)
	}
	s.nc, s.js = nc, js
	return s, nil
}

// PublishBatch publishes msgs on the publisher's connection, all sent before
// any acknowledgement is awaited, and returns one error per message: nil
// only for a message a stream acknowledged (a duplicate included: the
// stream holds it from an earlier attempt). See outbox.Publisher.
func (p *Publisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	errs := make([]error, len(msgs))
	s := p.conn.Load()
	if s == nil || s.isDead() {
		fill(errs, 0, fmt.Errorf("outboxnats: not connected: %w", outbox.ErrNotSent))
		return errs
	}
	stall := 200 * time.Millisecond
	if dl, ok := ctx.Deadline(); ok {
		stall = max(time.Until(dl), time.Millisecond)
	}
	futures := make([]jetstream.PubAckFuture, len(msgs))
	// A message not sent holds back the rest of its aggregate's run
	// (ErrNotSent): sent, they would be stored before it.
	type aggregate struct{ typ, id string }
	var unsent map[aggregate]bool
	holdBack := func(e outbox.Envelope) {
		if unsent == nil {
			unsent = map[aggregate]bool{}
		}
		unsent[aggregate{e.AggregateType, e.AggregateID}] = true
	}
	for i, e := range msgs {
		if err := ctx.Err(); err != nil {
			fill(errs, i, fmt.Errorf("outboxnats: %w: %w", err, outbox.ErrNotSent))
			break
		}
		if unsent[aggregate{e.AggregateType, e.AggregateID}] {
			errs[i] = fmt.Errorf("outboxnats: an earlier event of its aggregate could not be sent: %w", outbox.ErrNotSent)
			continue
		}
		m, err := p.Message(e)
		if err != nil {
			// Never sent, but counted as an attempt: the message itself is
			// at fault, and would be refused again.
			errs[i] = err
			holdBack(e)
			continue
		}
		f, err := s.js.PublishMsgAsync(m, jetstream.WithMsgID(e.MessageID()),
			jetstream.WithRetryAttempts(0), jetstream.WithStallWait(stall))
		if err == nil {
			futures[i] = f
			continue
		}
		if notSent(err) || s.isDead() {
			// This message and the rest stay in the process.
			fill(errs, i, fmt.Errorf("outboxnats: publish: %w: %w", err, outbox.ErrNotSent))
			break
		}
		// Refused by the client before sending (e.g. larger than the
		// server's max_payload): counted, as it would be refused again.
		errs[i] = fmt.Errorf("outboxnats: publish: %w", err)
		holdBack(e)
	}
	for i, f := range futures {
		if f != nil {
			errs[i] = verdict(ctx, s, f)
		}
	}
	return errs
}

// notSent tells the client's errors for a message it kept: no room for
// another acknowledgement before the deadline, no connection.
func notSent(err error) bool {
	for _, e := range []error{jetstream.ErrTooManyStalledMsgs, nats.ErrConnectionClosed,
		nats.ErrReconnectBufExceeded, nats.ErrConnectionDraining, nats.ErrInvalidConnection} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// verdict waits for f's acknowledgement, the end of the connection or of
// ctx, and returns its error: nil only on an acknowledgement.
func verdict(ctx context.Context, s *session, f jetstream.PubAckFuture) error {
	// An acknowledgement already here wins over a deadline or a loss
	// noticed at the same time.
	select {
	case <-f.Ok():
		return nil
	case err := <-f.Err():
		return ackError(err)
	default:
	}
	select {
	case <-f.Ok():
		return nil
	case err := <-f.Err():
		return ackError(err)
	case <-s.lost:
		select {
		case <-f.Ok():
			return nil
		default:
		}
		return fmt.Errorf("outboxnats: connection lost before the acknowledgement (outcome unknown): %w", s.causeErr())
	case <-ctx.Done():
		select {
		case <-f.Ok():
			return nil
		default:
		}
		return fmt.Errorf("outboxnats: no acknowledgement within the publish timeout (outcome unknown): %w", ctx.Err())
	}
}

func ackError(err error) error {
	if errors.Is(err, jetstream.ErrNoStreamResponse) {
		return fmt.Errorf("outboxnats: no stream takes the subject: %w: %w", err, outbox.ErrUnroutable)
	}
	var api *jetstream.APIError
	if errors.As(err, &api) {
		return fmt.Errorf("outboxnats: refused by the stream: %w", err)
	}
	return fmt.Errorf("outboxnats: no acknowledgement (outcome unknown): %w", err)
}

// Close closes the connection. Later WaitReady calls return ErrClosed;
// batches in flight get their unacknowledged messages reported as failed.
func (p *Publisher) Close() error {
	p.conn.Close(func(s *session) {
		s.nc.Close()
		s.markLost(ErrClosed)
	})
	return nil
}

// Subject returns the subject e is published to.
func (p *Publisher) Subject(e outbox.Envelope) string { return p.cfg.Subject(e) }

// HeaderCreatedAt carries the outbox row's creation time to the microsecond
// (RFC 3339, UTC).
const HeaderCreatedAt = "outbox_created_at"

// Message returns the NATS message the Publisher sends for e, without the
// Nats-Msg-Id header it adds (e.MessageID()): on e's subject, the payload
// as data, and the headers aggregate_type, aggregate_id, event_type,
// aggregate_version (decimal) and outbox_created_at over e's own headers.
// It refuses what NATS would not carry as it is: an invalid subject, a
// header name outside printable ASCII or with a colon, a name starting with
// "Nats-" (the server's own headers), or a value with a line break or
// surrounding white space (the client would change it).
func (p *Publisher) Message(e outbox.Envelope) (*nats.Msg, error) {
	subject := p.cfg.Subject(e)
	if err := checkSubject(subject); err != nil {
		return nil, fmt.Errorf("outboxnats: subject %q: %w", subject, err)
	}
	h := make(nats.Header, len(e.Headers)+5)
	for k, v := range e.Headers {
		if err := checkHeader(k, v); err != nil {
			return nil, fmt.Errorf("outboxnats: header %q: %w", k, err)
		}
		h.Set(k, v)
	}
	for k, v := range map[string]string{
		"aggregate_type": e.AggregateType, "aggregate_id": e.AggregateID, "event_type": e.EventType,
	} {
		if err := checkHeader(k, v); err != nil {
			return nil, fmt.Errorf("outboxnats: %s: %w", k, err)
		}
		h.Set(k, v)
	}
	h.Set("aggregate_version", strconv.FormatInt(e.AggregateVersion, 10))
	if !e.CreatedAt.IsZero() {
		h.Set(HeaderCreatedAt, e.CreatedAt.UTC().Format(time.RFC3339Nano))
	}
	return &nats.Msg{Subject: subject, Header: h, Data: e.Payload}, nil
}

// checkSubject accepts a subject of non-empty dot-separated tokens without
// white space or wildcards.
func checkSubject(s string) error {
	if s == "" {
		return errors.New("empty")
	}
	for tok := range strings.SplitSeq(s, ".") {
		if tok == "" || tok == "*" || tok == ">" {
			return errors.New("an empty token or a wildcard")
		}
		if strings.ContainsAny(tok, " \t\r\n") {
			return errors.New("white space")
		}
	}
	return nil
}

func checkHeader(k, v string) error {
	if k == "" {
		return errors.New("an empty name")
	}
	for i := range len(k) {
		if c := k[i]; c <= ' ' || c >= 0x7f || c == ':' {
			return errors.New("a NATS header name is printable ASCII without a colon")
		}
	}
	if len(k) >= 5 && strings.EqualFold(k[:5], "nats-") {
		return errors.New("names starting with Nats- are the server's")
	}
	if strings.ContainsAny(v, "\r\n") || textproto.TrimString(v) != v {
		return errors.New("a NATS header value has no line break nor surrounding white space")
	}
	return nil
}

func fill(errs []error, from int, err error) {
	for i := from; i < len(errs); i++ {
		errs[i] = err
	}
}

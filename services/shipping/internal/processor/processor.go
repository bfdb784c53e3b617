// Package processor turns an order-event delivery into a verdict: decode and
// validate it, apply it to its shipment through the inbox, and decide
// whether to ack, defer, park, dead-letter, or keep it until MongoDB is back.
//
//   - applied, or a duplicate (inbox record, or its version already holds
//     it: the version gate's mark, or the shipment): ack. An event type this service does not handle is applied as a
//     no-op at its version, so its order's later versions can apply.
//   - its previous version is missing (the inbox's version gate, keyed on
//     the order and the version, says inbox.ErrGap): defer through the delay queue (at
//     most MaxDeferrals times, then dead-letter gap_not_filled), unless its
//     order is held behind a dead letter of an earlier version: then park it
//     (kept in MongoDB, acked) until an operator replays or discards that
//     dead letter (package deadletter).
//   - the handler failed: defer as a retry, MaxAttempts times, then
//     dead-letter handler_failed.
//   - the inbox failed by itself (inbox.ErrTransient: "transient"; another
//     database error while MongoDB answers pings: "database"): defer,
//     without counting a handler attempt, at most MaxTransientDeferrals
//     times, then dead-letter inbox_failed. MongoDB not answering at all:
//     keep the delivery and retry (Retry), so its delivery limit is not
//     burnt.
//   - applied, or a duplicate, at the version its order is held at (a
//     second copy of a dead-lettered version, or a dead letter whose publish
//     failed after its record): the order is released (Config.Releases).
//   - whatever the reason, a message first deferred more than
//     MaxDeferralAge ago is dead-lettered instead of deferred again (the
//     time of its first deferral travels in a header): every message ends.
//   - a message that can never apply: dead-letter with its reason. With
//     Config.DeadLetters, a dead letter whose order and version are known is
//     recorded with its message first, and holds its order.
//
// The event type is the AMQP type property, else the event_type header, else
// the routing key the message was first published with (the delay queue
// changes the routing key; the original is kept in x-original-routing-key).
// A message in the CloudEvents envelope is read by its attributes instead,
// and one that is no valid event is dead-lettered as invalid_cloudevent
// (shipment.Decode).
package processor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/inboxotel"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Headers counting a message's trips through the delay queue.
const (
	// HeaderAttempts counts failed handler runs (Defer "retry").
	HeaderAttempts = "x-shipping-attempts"
	// HeaderDeferrals counts deferrals while waiting for an earlier version
	// or for another consumer's claim.
	HeaderDeferrals = "x-shipping-deferrals"
	// HeaderTransientDeferrals counts deferrals because the inbox failed by
	// itself (Defer "transient" and "database").
	HeaderTransientDeferrals = "x-shipping-transient-deferrals"
	// HeaderFirstDeferredAt is when the message was first deferred, for any
	// reason, in Unix milliseconds (MaxDeferralAge).
	HeaderFirstDeferredAt = "x-shipping-first-deferred-at"
	// HeaderCreatedAt is the outbox row's creation time (RFC 3339, to the
	// microsecond) that the relay sends with each event of the outbox
	// envelope (docs/events.md): the start of the commit-to-applied time
	// (in the CloudEvents envelope: the time attribute).
	HeaderCreatedAt = shipment.HeaderCreatedAt
)

// Inbox deduplicates by message id and applies each order's versions in
// order (pkg/inbox's Gate over its Inbox).
type Inbox interface {
	Process(ctx context.Context, msgID string, pos inbox.Position, h inbox.Handler) (inbox.Result, error)
}

// Store applies events to shipments, recording which message applied each
// version (the shipping service plugs in its MongoDB store). The Inbox's
// gate runs it only once the event's previous version is applied.
type Store interface {
	Apply(ctx context.Context, messageID string, ev shipment.Event) (shipment.Outcome, error)
	Ping(ctx context.Context) error
}

// DeadLetters keeps dead letters and parks the later versions of the
// orders they hold (services/shipping/internal/deadletter).
type DeadLetters interface {
	Record(ctx context.Context, l shipment.Letter) error
	Held(ctx context.Context, orderID string) (*shipment.Hold, error)
	Park(ctx context.Context, p shipment.Parked) error
	Unpark(ctx context.Context, orderID string, version int64) (bool, error)
}

// Releases releases an order held behind a dead letter whose version was
// applied after all, or whose gap the applied version filled
// (services/shipping/internal/deadletter).
type Releases interface {
	Applied(ctx context.Context, orderID string, version int64) (int, error)
}

var _ Inbox = (*inbox.Gate)(nil)

// Config configures a Processor.
type Config struct {
	Inbox   Inbox            // required
	Store   Store            // required
	Metrics *metrics.Metrics // required
	// MaxAttempts is how many times a failing handler runs before the
	// message is dead-lettered (reason handler_failed). Default: 5.
	MaxAttempts int
	// MaxDeferrals is how many times a message waits in the delay queue for
	// an earlier version (or a live claim) before it is dead-lettered
	// (reason gap_not_filled). With the default 1s delay, the default 300
	// waits about five minutes.
	MaxDeferrals int
	// MaxTransientDeferrals is how many times a message is deferred because
	// the inbox failed by itself (inbox.ErrTransient after its retry budget,
	// or a database error while MongoDB answers, such as Unauthorized)
	// before it is dead-lettered (reason inbox_failed). Default: 20 (with a
	// transaction's 90s budget and the 1s delay, about half an hour; a
	// database error that fails at once, about 20s).
	MaxTransientDeferrals int
	// MaxDeferralAge bounds how long a message keeps being deferred, for any
	// reason, counted from its first deferral: past it, the next deferral
	// dead-letters it instead (gap_not_filled, handler_failed or
	// inbox_failed, after what it was deferred for). Default: 30m.
	MaxDeferralAge time.Duration
	// DeadLetters, when set, records each dead letter whose order and
	// version are known, with its message, and holds its order: a later
	// version of a held order that finds its predecessor missing is parked
	// at once (acked, kept in MongoDB) instead of waiting in the delay queue,
	// until an operator replays or discards the dead letter. Default: nil
	// (dead letters only go to the dead-letter queue).
	DeadLetters DeadLetters
	// Releases releases an order whose held version was applied after all
	// (a second copy of it, or the redelivery of a message whose dead letter
	// was recorded but not published): its parked messages go out again in
	// version order and the hold is gone. It is asked after every applied
	// message and duplicate (one lookup by _id). Default: nil (the order
	// stays held until an operator replays or discards its dead letter).
	Releases Releases
	// Crash arms the crash points shipping.after_effect_before_inbox and
	// shipping.after_inbox_before_ack. Default: nil (disarmed).
	Crash *crashpoint.Trigger
	// Logger. Default: discard.
	Logger *slog.Logger
	// Tracing, when set, runs the effect in a span of its own ("apply
	// shipment", a child of the delivery's process span, beside the inbox's
	// check and record spans when the inbox has inboxotel's hooks). Whatever
	// it is, the delivery's span in ctx (if recording) gets the event's
	// attributes, inbox.duplicate, and the handler's error. Default: nil (no
	// effect span).
	Tracing *inboxotel.Tracing
}

// SpanApply names the effect's span.
const SpanApply = "apply shipment"

// Span attributes set by the processor.
const (
	// AttrOutcome (on the effect span): applied, already_applied (the
	// version holds this message: a duplicate the inbox did not know), or
	// ignored (an event type this service does not handle).
	AttrOutcome = attribute.Key("shipping.outcome")
	// AttrAttempt (on the process span): this run's number among the
	// failed handler runs of the message (x-shipping-attempts + 1).
	AttrAttempt = attribute.Key("shipping.attempt")
	// AttrDeferrals (on the process span): how often the message waited in
	// the delay queue.
	AttrDeferrals = attribute.Key("shipping.deferrals")
	// The event's own attributes, named as the relay's publish span names
	// them.
	AttrAggregateType    = attribute.Key("outbox.aggregate.type")
	AttrAggregateID      = attribute.Key("outbox.aggregate.id")
	AttrAggregateVersion = attribute.Key("outbox.aggregate.version")
	AttrEventType        = attribute.Key("outbox.event.type")
)

// Defaults of Config.
const (
	DefaultMaxAttempts           = 5
	DefaultMaxDeferrals          = 300
	DefaultMaxTransientDeferrals = 20
	DefaultMaxDeferralAge        = shipment.DefaultMaxDeferralAge
)

// Processor is the shipping service's handler of deliveries: the RabbitMQ
// consumer's Handler (services/shipping/internal/rabbitmq).
type Processor struct {
	cfg Config
	log *slog.Logger
}

// New returns a Processor.
func New(cfg Config) (*Processor, error) {
	if cfg.Inbox == nil || cfg.Store == nil || cfg.Metrics == nil {
		return nil, errors.New("processor: Inbox, Store and Metrics are required")
	}
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, DefaultMaxAttempts)
	cfg.MaxDeferrals = cmp.Or(cfg.MaxDeferrals, DefaultMaxDeferrals)
	cfg.MaxTransientDeferrals = cmp.Or(cfg.MaxTransientDeferrals, DefaultMaxTransientDeferrals)
	cfg.MaxDeferralAge = cmp.Or(cfg.MaxDeferralAge, DefaultMaxDeferralAge)
	if cfg.MaxAttempts < 1 || cfg.MaxDeferrals < 1 || cfg.MaxTransientDeferrals < 1 {
		return nil, fmt.Errorf("processor: MaxAttempts %d, MaxDeferrals %d, MaxTransientDeferrals %d: want at least 1",
			cfg.MaxAttempts, cfg.MaxDeferrals, cfg.MaxTransientDeferrals)
	}
	if cfg.MaxDeferralAge < time.Second {
		return nil, fmt.Errorf("processor: MaxDeferralAge %v: want at least 1s", cfg.MaxDeferralAge)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Processor{cfg: cfg, log: log}, nil
}

// Handle decides what happens to d.
func (p *Processor) Handle(ctx context.Context, d shipment.Delivery) (v shipment.Verdict) {
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			// A bug, not a message problem; count it as a failed attempt.
			v = p.failed(ctx, d, shipment.Event{}, fmt.Errorf("panic: %v", r))
		}
		if v.Action != shipment.Retry {
			p.cfg.Metrics.HandlerDuration.Observe(time.Since(start).Seconds())
		}
	}()

	// The message id is the inbox's key, decided once (shipment.MessageID)
	// and handed as it is to the inbox, which alone decides whether it can
	// be one (inbox.ErrInvalidMessageID), and to the store.
	msg := p.message(d)
	msgID := shipment.MessageID(msg)
	ev, err := shipment.Decode(msg)
	var inv *shipment.InvalidError
	switch {
	case errors.As(err, &inv):
		return p.deadLetter(ctx, d, ev, inv.Reason, inv.Err)
	case err != nil:
		return p.deadLetter(ctx, d, ev, shipment.ReasonMalformedPayload, err)
	}
	log := p.log.With("event_id", msgID, "aggregate_id", ev.OrderID, "event_type", ev.Type, "version", ev.Version)
	span := trace.SpanFromContext(ctx)
	if span.IsRecording() {
		span.SetAttributes(
			AttrAggregateType.String(ev.AggregateType),
			AttrAggregateID.String(ev.OrderID),
			AttrAggregateVersion.Int64(ev.Version),
			AttrEventType.String(ev.Type),
			AttrAttempt.Int64(headerInt(d.Headers, HeaderAttempts)+1),
			AttrDeferrals.Int64(headerInt(d.Headers, HeaderDeferrals)),
		)
	}

	var outcome shipment.Outcome
	apply := func(ctx context.Context) error {
		o, err := p.cfg.Store.Apply(ctx, msgID, ev)
		if err != nil {
			return err
		}
		outcome = o
		if s := trace.SpanFromContext(ctx); s.IsRecording() {
			s.SetAttributes(AttrOutcome.String(outcomeName(o, ev)))
		}
		p.cfg.Crash.Hit(crashpoint.ShippingAfterEffectBeforeInbox)
		return nil
	}
	if p.cfg.Tracing != nil {
		apply = p.cfg.Tracing.Handler(SpanApply, apply)
	}
	res, err := p.cfg.Inbox.Process(ctx, msgID, inbox.Position{Aggregate: ev.OrderID, Version: ev.Version}, apply)
	if span.IsRecording() {
		if err != nil {
			span.RecordError(err)
		} else {
			span.SetAttributes(inboxotel.AttrDuplicate.Bool(res == inbox.Duplicate))
		}
	}
	switch {
	case err == nil:
	case errors.Is(err, inbox.ErrGap):
		if v, parked := p.park(ctx, log, d, ev); parked {
			return v
		}
		return p.deferred(ctx, log, d, ev, "gap", err)
	case errors.Is(err, inbox.ErrInProgress):
		return p.deferred(ctx, log, d, ev, "in_progress", err)
	case errors.Is(err, inbox.ErrVersionConflict), errors.Is(err, shipment.ErrVersionConflict):
		return p.deadLetter(ctx, d, ev, shipment.ReasonVersionConflict, err)
	case errors.Is(err, inbox.ErrInvalidPosition):
		return p.deadLetter(ctx, d, ev, shipment.ReasonMalformedPayload, err)
	case errors.Is(err, inbox.ErrInvalidMessageID):
		return p.deadLetter(ctx, d, ev, shipment.ReasonMissingMessageID, err)
	case errors.Is(err, inbox.ErrBeyondHorizon):
		return p.deadLetter(ctx, d, ev, shipment.ReasonBeyondHorizon, err)
	case ctx.Err() != nil:
		return shipment.Verdict{Action: shipment.Retry} // shutting down or connection lost
	case errors.Is(err, inbox.ErrTransient):
		// Transaction mode: transient errors (a write conflict with an
		// orphaned transaction, a failover) outlasted the inbox's retry
		// budget, whatever error the last attempt carried. Not the message's
		// fault: try it again later without counting an attempt, within
		// MaxTransientDeferrals.
		log.WarnContext(ctx, "transient inbox failure, deferring the message", "error", err)
		return p.transient(ctx, log, d, ev, "transient", err)
	default:
		// Is MongoDB there at all? If not, keep the delivery and wait:
		// burning attempts on an outage would dead-letter good messages.
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		perr := p.cfg.Store.Ping(pctx)
		cancel()
		if perr != nil {
			p.cfg.Metrics.MongoUnavailable.Inc()
			log.WarnContext(ctx, "MongoDB unavailable, keeping the delivery until it is back", "error", err)
			return shipment.Verdict{Action: shipment.Retry}
		}
		if !errors.Is(err, inbox.ErrHandler) {
			// The inbox itself failed (a database error such as
			// Unauthorized, a commit whose outcome is unknown): nothing was
			// recorded and the message is not at fault. Try it again later
			// without counting an attempt against it, within
			// MaxTransientDeferrals.
			log.WarnContext(ctx, "inbox failed, deferring the message", "error", err)
			return p.transient(ctx, log, d, ev, "database", err)
		}
		log.WarnContext(ctx, "handler failed", "error", err)
		return p.failed(ctx, d, ev, err)
	}

	switch {
	case res == inbox.Duplicate:
		p.cfg.Metrics.Duplicates.WithLabelValues("inbox").Inc()
		log.DebugContext(ctx, "duplicate (inbox)")
	case res == inbox.AlreadyApplied || outcome == shipment.OutcomeAlreadyApplied:
		p.cfg.Metrics.Duplicates.WithLabelValues("version").Inc()
		log.DebugContext(ctx, "duplicate (already applied)")
	case ev.Ignored:
		p.cfg.Metrics.UnknownType.Inc()
		log.WarnContext(ctx, "unknown event type, recorded as a no-op at its version so that later versions apply")
	default:
		p.cfg.Metrics.Processed.Inc()
		if created, ok := shipment.CreatedAt(d.Headers); ok {
			p.cfg.Metrics.ObserveCommitToApplied(ctx, created, time.Now())
		}
		log.DebugContext(ctx, "applied")
	}
	if p.cfg.Releases != nil {
		// Before the ack: a crash here leaves the delivery to come again, a
		// duplicate that releases the order then.
		// The manager logs the release.
		if _, err := p.cfg.Releases.Applied(ctx, ev.OrderID, ev.Version); err != nil {
			log.WarnContext(ctx, "applied at the version its order is held at, but could not release the order; keeping the delivery", "error", err)
			return shipment.Verdict{Action: shipment.Retry}
		}
	}
	p.cfg.Crash.Hit(crashpoint.ShippingAfterInboxBeforeAck)
	return shipment.Verdict{Action: shipment.Ack}
}

// outcomeName is AttrOutcome's value.
func outcomeName(o shipment.Outcome, ev shipment.Event) string {
	switch {
	case o == shipment.OutcomeAlreadyApplied:
		return "already_applied"
	case ev.Ignored:
		return "ignored"
	default:
		return "applied"
	}
}

// originalRoutingKey is the routing key the message was first published
// with: a message back from the delay queue carries the queue's name as its
// routing key, and its first one in a header.
func originalRoutingKey(d shipment.Delivery) string {
	if k, ok := d.Headers[shipment.HeaderOriginalRoutingKey].(string); ok && k != "" {
		return k
	}
	return d.RoutingKey
}

func deadLetter(r shipment.Reason, err error) shipment.Verdict {
	return shipment.Verdict{Action: shipment.DeadLetter, Reason: string(r), Detail: err.Error()}
}

// deadLetter dead-letters d. With DeadLetters, a message whose order and
// version are known is recorded first (with its message, for a replay), and
// holds its order unless its version is applied anyway (a version
// conflict); if that record cannot be written, the delivery is kept.
func (p *Processor) deadLetter(ctx context.Context, d shipment.Delivery, ev shipment.Event, r shipment.Reason, err error) shipment.Verdict {
	v := deadLetter(r, err)
	if p.cfg.DeadLetters == nil || r == shipment.ReasonMissingMessageID {
		return v
	}
	msg := p.message(d)
	orderID, version, typ := ev.OrderID, ev.Version, ev.Type
	if orderID == "" {
		var ok bool
		if orderID, version, ok = shipment.Locate(msg); !ok {
			return v
		}
		typ = d.Type
	}
	l := shipment.Letter{
		OrderID: orderID, Version: version, EventType: typ, Reason: string(r), Error: truncate(err.Error(), 1024),
		Holds: r != shipment.ReasonVersionConflict, AwaitsPredecessor: r == shipment.ReasonGapNotFilled,
		DeadLetteredAt: time.Now().UTC(), Message: keep(d, shipment.MessageID(msg)),
	}
	if rerr := p.cfg.DeadLetters.Record(ctx, l); rerr != nil {
		p.log.WarnContext(ctx, "could not record the dead letter, keeping the delivery", "event_id", shipment.MessageID(msg),
			"aggregate_id", orderID, "version", version, "reason", string(r), "error", rerr)
		return shipment.Verdict{Action: shipment.Retry}
	}
	return v
}

// park parks d when its order is held behind a dead letter of an earlier
// version. It reports whether it settled the delivery.
func (p *Processor) park(ctx context.Context, log *slog.Logger, d shipment.Delivery, ev shipment.Event) (shipment.Verdict, bool) {
	if p.cfg.DeadLetters == nil {
		return shipment.Verdict{}, false
	}
	retry := func(err error) (shipment.Verdict, bool) {
		log.WarnContext(ctx, "could not check or park behind a dead letter, keeping the delivery", "error", err)
		return shipment.Verdict{Action: shipment.Retry}, true
	}
	hold, err := p.cfg.DeadLetters.Held(ctx, ev.OrderID)
	if err != nil {
		return retry(err)
	}
	if hold == nil || hold.State != shipment.StateHeld || hold.Version >= ev.Version {
		return shipment.Verdict{}, false
	}
	err = p.cfg.DeadLetters.Park(ctx, shipment.Parked{
		OrderID: ev.OrderID, Version: ev.Version, ParkedAt: time.Now().UTC(), Message: keep(d, shipment.MessageID(p.message(d))),
	})
	if errors.Is(err, shipment.ErrParkedConflict) {
		return p.deadLetter(ctx, d, ev, shipment.ReasonVersionConflict, err), true
	}
	if err != nil {
		return retry(err)
	}
	// A release that began meanwhile may not see this message: re-read the
	// hold, and take the message back if it is no longer the one parked
	// behind.
	again, err := p.cfg.DeadLetters.Held(ctx, ev.OrderID)
	if err != nil {
		return retry(err) // handled again: parking is idempotent
	}
	if again != nil && again.State == shipment.StateHeld && again.Token == hold.Token {
		p.cfg.Metrics.Parked.Inc()
		log.InfoContext(ctx, "parked behind a dead letter", "dead_version", hold.Version)
		return shipment.Verdict{Action: shipment.Ack}, true
	}
	took, err := p.cfg.DeadLetters.Unpark(ctx, ev.OrderID, ev.Version)
	if err != nil {
		return retry(err)
	}
	if !took {
		return shipment.Verdict{Action: shipment.Ack}, true // the release re-published it
	}
	return shipment.Verdict{}, false
}

// message is d as shipment.Decode reads it.
func (p *Processor) message(d shipment.Delivery) shipment.Message {
	return shipment.Message{
		MessageID: d.MessageID, Type: d.Type, ContentType: d.ContentType, RoutingKey: originalRoutingKey(d), Headers: d.Headers, Body: d.Body,
	}
}

// transportHeaders are set by the consumer, the broker or this processor
// on a delivery's trips; a kept message drops them, so a replay starts
// afresh.
var transportHeaders = []string{
	HeaderAttempts, HeaderDeferrals, HeaderTransientDeferrals, HeaderFirstDeferredAt, shipment.HeaderReason, shipment.HeaderError, shipment.HeaderDeadLetteredBy,
	"x-delivery-count", "x-shipping-publish-seq", "x-death", "x-first-death-exchange", "x-first-death-queue",
	"x-first-death-reason", "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason",
}

// keep is d, whose message id is id (shipment.MessageID), as kept for a
// later re-publish.
func keep(d shipment.Delivery, id string) shipment.KeptMessage {
	h := make(map[string]any, len(d.Headers))
	for k, v := range d.Headers {
		h[k] = v
	}
	for _, k := range transportHeaders {
		delete(h, k)
	}
	if _, ok := h[shipment.HeaderOriginalRoutingKey]; !ok {
		h[shipment.HeaderOriginalExchange] = d.Exchange
		h[shipment.HeaderOriginalRoutingKey] = d.RoutingKey
	}
	return shipment.KeptMessage{
		MessageID: id, Type: d.Type, ContentType: "application/json",
		RoutingKey: originalRoutingKey(d), Headers: h, Body: d.Body,
	}
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// deferred sends the message through the delay queue, up to MaxDeferrals
// times.
func (p *Processor) deferred(ctx context.Context, log *slog.Logger, d shipment.Delivery, ev shipment.Event, reason string, err error) shipment.Verdict {
	n := headerInt(d.Headers, HeaderDeferrals) + 1
	if n > int64(p.cfg.MaxDeferrals) {
		return p.deadLetter(ctx, d, ev, shipment.ReasonGapNotFilled, fmt.Errorf("still waiting after %d deferrals: %w", n-1, err))
	}
	return p.deferOrExpire(ctx, log, d, ev, reason, HeaderDeferrals, n, shipment.ReasonGapNotFilled, err)
}

// transient defers a message the inbox failed on by itself, up to
// MaxTransientDeferrals times.
func (p *Processor) transient(ctx context.Context, log *slog.Logger, d shipment.Delivery, ev shipment.Event, reason string, err error) shipment.Verdict {
	n := headerInt(d.Headers, HeaderTransientDeferrals) + 1
	if n > int64(p.cfg.MaxTransientDeferrals) {
		return p.deadLetter(ctx, d, ev, shipment.ReasonInboxFailed, fmt.Errorf("the inbox still failed after %d deferrals: %w", n-1, err))
	}
	return p.deferOrExpire(ctx, log, d, ev, reason, HeaderTransientDeferrals, n, shipment.ReasonInboxFailed, err)
}

// failed counts a failed handler run: retry through the delay queue, or
// dead-letter once MaxAttempts runs failed.
func (p *Processor) failed(ctx context.Context, d shipment.Delivery, ev shipment.Event, err error) shipment.Verdict {
	n := headerInt(d.Headers, HeaderAttempts) + 1
	if n >= int64(p.cfg.MaxAttempts) {
		return p.deadLetter(ctx, d, ev, shipment.ReasonHandlerFailed, fmt.Errorf("failed %d times, last: %w", n, err))
	}
	return p.deferOrExpire(ctx, p.log, d, ev, "retry", HeaderAttempts, n, shipment.ReasonHandlerFailed, err)
}

// deferOrExpire defers d with counter set to n, unless it was first
// deferred more than MaxDeferralAge ago: then it dead-letters it with
// expired.
func (p *Processor) deferOrExpire(ctx context.Context, log *slog.Logger, d shipment.Delivery, ev shipment.Event,
	reason, counter string, n int64, expired shipment.Reason, err error) shipment.Verdict {
	now := time.Now()
	first := now
	if ms := headerInt(d.Headers, HeaderFirstDeferredAt); ms > 0 {
		first = time.UnixMilli(ms)
	}
	if age := now.Sub(first); age > p.cfg.MaxDeferralAge {
		return p.deadLetter(ctx, d, ev, expired, fmt.Errorf("still deferred %v after its first deferral (at most %v), %s %d: %w",
			age.Round(time.Second), p.cfg.MaxDeferralAge, counter, n-1, err))
	}
	log.DebugContext(ctx, "deferred", "reason", reason, counter, n)
	return shipment.Verdict{Action: shipment.Defer, Reason: reason, Headers: map[string]any{counter: n, HeaderFirstDeferredAt: first.UnixMilli()}}
}

func headerInt(h map[string]any, k string) int64 {
	switch v := h[k].(type) {
	case int64:
		return v
	case int32:
		return int64(v)
	case int16:
		return int64(v)
	case int8:
		return int64(v)
	case int:
		return int64(v)
	}
	return 0
}

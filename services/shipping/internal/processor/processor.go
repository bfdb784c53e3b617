// Package processor turns an order-event delivery into a verdict: decode and
// validate it, apply it to its shipment through the inbox, and decide
// whether to ack, defer, dead-letter, or keep it until MongoDB is back.
package processor

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Headers counting a message's trips through the delay queue.
const (
	// HeaderAttempts counts failed handler runs (Defer "retry").
	HeaderAttempts = "x-shipping-attempts"
	// HeaderDeferrals counts deferrals while waiting for an earlier version
	// or for another consumer's claim.
	HeaderDeferrals = "x-shipping-deferrals"
)

// Inbox deduplicates by message id (pkg/inbox).
type Inbox interface {
	Process(ctx context.Context, msgID string, h inbox.Handler) (inbox.Result, error)
}

// Store applies events to shipments (services/shipping/internal/mongodb).
type Store interface {
	Apply(ctx context.Context, ev shipment.Event) (mongodb.Outcome, error)
	Ping(ctx context.Context) error
}

var (
	_ Inbox            = (*inbox.Inbox)(nil)
	_ Store            = (*mongodb.Store)(nil)
	_ rabbitmq.Handler = (*Processor)(nil)
)

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
	// Crash arms the crash points shipping.after_effect_before_inbox and
	// shipping.after_inbox_before_ack. Default: nil (disarmed).
	Crash *crashpoint.Trigger
	// Logger. Default: discard.
	Logger *slog.Logger
}

// Processor is the shipping service's rabbitmq.Handler.
type Processor struct {
	cfg Config
	log *slog.Logger
}

// New returns a Processor.
func New(cfg Config) (*Processor, error) {
	if cfg.Inbox == nil || cfg.Store == nil || cfg.Metrics == nil {
		return nil, errors.New("processor: Inbox, Store and Metrics are required")
	}
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, 5)
	cfg.MaxDeferrals = cmp.Or(cfg.MaxDeferrals, 300)
	if cfg.MaxAttempts < 1 || cfg.MaxDeferrals < 1 {
		return nil, fmt.Errorf("processor: MaxAttempts %d, MaxDeferrals %d: want at least 1", cfg.MaxAttempts, cfg.MaxDeferrals)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Processor{cfg: cfg, log: log}, nil
}

// Handle implements rabbitmq.Handler.
func (p *Processor) Handle(ctx context.Context, d rabbitmq.Delivery) (v rabbitmq.Verdict) {
	start := time.Now()
	defer func() {
		if r := recover(); r != nil {
			// A bug, not a message problem; count it as a failed attempt.
			v = p.failed(d, fmt.Errorf("panic: %v", r))
		}
		if v.Action != rabbitmq.Retry {
			p.cfg.Metrics.HandlerDuration.Observe(time.Since(start).Seconds())
		}
	}()

	ev, err := shipment.Decode(shipment.Message{
		MessageID: d.MessageID, Type: d.Type, RoutingKey: originalRoutingKey(d), Headers: d.Headers, Body: d.Body,
	})
	var inv *shipment.InvalidError
	switch {
	case errors.As(err, &inv):
		return deadLetter(inv.Reason, inv.Err)
	case err != nil:
		return deadLetter(shipment.ReasonMalformedPayload, err)
	}
	log := p.log.With("event_id", ev.MessageID, "aggregate_id", ev.OrderID, "event_type", ev.Type, "version", ev.Version)

	var outcome mongodb.Outcome
	res, err := p.cfg.Inbox.Process(ctx, ev.MessageID, func(ctx context.Context) error {
		o, err := p.cfg.Store.Apply(ctx, ev)
		if err != nil {
			return err
		}
		outcome = o
		p.cfg.Crash.Hit(crashpoint.ShippingAfterEffectBeforeInbox)
		return nil
	})
	switch {
	case err == nil:
	case errors.Is(err, shipment.ErrGap):
		return p.deferred(ctx, log, d, "gap", err)
	case errors.Is(err, inbox.ErrInProgress):
		return p.deferred(ctx, log, d, "in_progress", err)
	case errors.Is(err, shipment.ErrVersionConflict):
		return deadLetter(shipment.ReasonVersionConflict, err)
	case errors.Is(err, inbox.ErrInvalidMessageID):
		return deadLetter(shipment.ReasonMissingMessageID, err)
	case ctx.Err() != nil:
		return rabbitmq.Verdict{Action: rabbitmq.Retry} // shutting down or connection lost
	default:
		// Is MongoDB there at all? If not, keep the delivery and wait:
		// burning attempts on an outage would dead-letter good messages.
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		perr := p.cfg.Store.Ping(pctx)
		cancel()
		if perr != nil {
			p.cfg.Metrics.MongoUnavailable.Inc()
			log.WarnContext(ctx, "MongoDB unavailable, keeping the delivery until it is back", "error", err)
			return rabbitmq.Verdict{Action: rabbitmq.Retry}
		}
		if !errors.Is(err, inbox.ErrHandler) {
			// The inbox itself failed (a database error, a transient
			// transaction error that outlasted its retries, a commit whose
			// outcome stayed unknown): nothing was recorded and the message
			// is not at fault. Try it again later without counting an
			// attempt against it.
			log.WarnContext(ctx, "inbox failed, deferring the message", "error", err)
			return rabbitmq.Verdict{Action: rabbitmq.Defer, Reason: "transient"}
		}
		log.WarnContext(ctx, "handler failed", "error", err)
		return p.failed(d, err)
	}

	switch {
	case res == inbox.Duplicate:
		p.cfg.Metrics.Duplicates.WithLabelValues("inbox").Inc()
		log.DebugContext(ctx, "duplicate (inbox)")
	case outcome == mongodb.AlreadyApplied:
		p.cfg.Metrics.Duplicates.WithLabelValues("version").Inc()
		log.DebugContext(ctx, "duplicate (already applied)")
	case ev.Ignored:
		p.cfg.Metrics.UnknownType.Inc()
		log.InfoContext(ctx, "event type not handled here, recorded as a no-op at its version")
	default:
		p.cfg.Metrics.Processed.Inc()
		log.DebugContext(ctx, "applied")
	}
	p.cfg.Crash.Hit(crashpoint.ShippingAfterInboxBeforeAck)
	return rabbitmq.Verdict{Action: rabbitmq.Ack}
}

// originalRoutingKey is the routing key the message was first published
// with: a message back from the delay queue carries the queue's name as its
// routing key, and its first one in a header.
func originalRoutingKey(d rabbitmq.Delivery) string {
	if k, ok := d.Headers[rabbitmq.HeaderOriginalRoutingKey].(string); ok && k != "" {
		return k
	}
	return d.RoutingKey
}

func deadLetter(r shipment.Reason, err error) rabbitmq.Verdict {
	return rabbitmq.Verdict{Action: rabbitmq.DeadLetter, Reason: string(r), Detail: err.Error()}
}

// deferred sends the message through the delay queue, up to MaxDeferrals
// times.
func (p *Processor) deferred(ctx context.Context, log *slog.Logger, d rabbitmq.Delivery, reason string, err error) rabbitmq.Verdict {
	n := headerInt(d.Headers, HeaderDeferrals) + 1
	if n > int64(p.cfg.MaxDeferrals) {
		return deadLetter(shipment.ReasonGapNotFilled, fmt.Errorf("still waiting after %d deferrals: %w", n-1, err))
	}
	log.DebugContext(ctx, "deferred", "reason", reason, "deferrals", n)
	return rabbitmq.Verdict{Action: rabbitmq.Defer, Reason: reason, Headers: map[string]any{HeaderDeferrals: n}}
}

// failed counts a failed handler run: retry through the delay queue, or
// dead-letter once MaxAttempts runs failed.
func (p *Processor) failed(d rabbitmq.Delivery, err error) rabbitmq.Verdict {
	n := headerInt(d.Headers, HeaderAttempts) + 1
	if n >= int64(p.cfg.MaxAttempts) {
		return deadLetter(shipment.ReasonHandlerFailed, fmt.Errorf("failed %d times, last: %w", n, err))
	}
	return rabbitmq.Verdict{Action: rabbitmq.Defer, Reason: "retry", Headers: map[string]any{HeaderAttempts: n}}
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

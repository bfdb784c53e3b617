package deadletter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Publisher re-publishes a kept message to the consumer's queue and returns
// once the broker confirmed it (the service plugs in
// rabbitmq.ReplayPublisher).
type Publisher interface {
	Publish(ctx context.Context, m shipment.KeptMessage) error
}

// Skipper records a version of an order as skipped, so that the versions
// after it apply (services/shipping/internal/mongodb).
type Skipper interface {
	Skip(ctx context.Context, orderID string, version int64, messageID, eventType string) error
}

// Config configures a Manager.
type Config struct {
	Store     *Store    // required
	Publisher Publisher // required
	Skipper   Skipper   // required
	// Logger. Default: discard.
	Logger *slog.Logger
	// Crash arms the crash point shipping.release_after_publish, hit after
	// each confirmed re-publish of a parked message, before its parked copy
	// is deleted. Default: nil (disarmed).
	Crash *crashpoint.Trigger
}

// Manager replays and discards dead letters and releases their orders.
type Manager struct {
	cfg Config
	log *slog.Logger
}

// NewManager returns a Manager.
func NewManager(cfg Config) (*Manager, error) {
	if cfg.Store == nil || cfg.Publisher == nil || cfg.Skipper == nil {
		return nil, errors.New("deadletter: Store, Publisher and Skipper are required")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Manager{cfg: cfg, log: log}, nil
}

// List returns the dead letters and the held orders.
func (m *Manager) List(ctx context.Context) ([]shipment.Letter, []shipment.Hold, error) {
	return m.cfg.Store.List(ctx)
}

// Replay re-publishes the dead letter at orderID/version to the consumer's
// queue, then releases its order's parked messages, in version order. It
// returns how many parked messages it released. Replaying an order whose
// release was interrupted resumes it.
func (m *Manager) Replay(ctx context.Context, orderID string, version int64) (int, error) {
	// Refused before the release begins: a hold left "releasing" would be
	// resumed, and refused, at every start.
	if l, err := m.cfg.Store.letter(ctx, orderID, version); err != nil {
		return 0, err
	} else if l != nil && l.Message.BodyOmitted > 0 {
		return 0, fmt.Errorf("replay dead letter %s: %w (%d bytes)", key(orderID, version), shipment.ErrBodyNotKept, l.Message.BodyOmitted)
	}
	return m.settle(ctx, orderID, version, actionReplay, func(l shipment.Letter) error {
		if err := m.cfg.Publisher.Publish(ctx, l.Message); err != nil {
			return fmt.Errorf("replay dead letter %s: %w", key(orderID, version), err)
		}
		return nil
	})
}

// Discard drops the dead letter at orderID/version: its version is recorded
// as skipped in the shipment (so the versions after it apply), and its
// order's parked messages are released, in version order. It returns how
// many parked messages it released. Discarding an order whose release was
// interrupted resumes it.
func (m *Manager) Discard(ctx context.Context, orderID string, version int64) (int, error) {
	return m.settle(ctx, orderID, version, actionDiscard, func(l shipment.Letter) error {
		if err := m.cfg.Skipper.Skip(ctx, orderID, version, l.Message.MessageID, l.EventType); err != nil {
			return fmt.Errorf("discard dead letter %s: %w", key(orderID, version), err)
		}
		return nil
	})
}

// Applied is called after version of orderID applied (or was found
// applied). It releases orderID when its hold is at version, which was
// applied after all: a second copy of the dead-lettered message (the relay
// published it again), or the redelivery of a message whose dead letter was
// recorded but whose publish to the dead-letter queue failed. The dead
// letter at that version is dropped (its version is applied) and the order's
// parked messages are re-published in version order. When the hold is at the
// next version instead, and that dead letter only waited for this one
// (shipment.Letter.AwaitsPredecessor), its gap is filled: it is replayed (Replay).
// It returns how many parked messages it released: 0, with no write, when
// neither is the case. A release an operator began (replay, discard) is
// left to finish on its own.
func (m *Manager) Applied(ctx context.Context, orderID string, version int64) (int, error) {
	hold, err := m.cfg.Store.Held(ctx, orderID)
	if err != nil || hold == nil {
		return 0, err
	}
	switch {
	case hold.Version == version:
		if hold.State != shipment.StateHeld && hold.Action != actionApplied {
			return 0, nil
		}
		return m.settle(ctx, orderID, version, actionApplied, nil)
	case hold.Version == version+1 && hold.State == shipment.StateHeld:
		l, err := m.cfg.Store.letter(ctx, orderID, version+1)
		if err != nil || l == nil || !l.AwaitsPredecessor {
			return 0, err
		}
		m.log.InfoContext(ctx, "the version a dead letter waited for applied: replaying it", "aggregate_id", orderID,
			"version", version+1, "event_id", l.Message.MessageID)
		return m.Replay(ctx, orderID, version+1)
	}
	return 0, nil
}

// Release actions, kept on a releasing hold.
const (
	actionReplay  = "replay"
	actionDiscard = "discard"
	actionApplied = "applied" // the held version applied after all (Applied)
)

// Resume finishes every release that was interrupted (its hold is still
// "releasing"), repeating the action the operator asked. It returns how
// many releases it finished.
func (m *Manager) Resume(ctx context.Context) (int, error) {
	holds, err := m.cfg.Store.releasing(ctx)
	if err != nil {
		return 0, err
	}
	done := 0
	for _, h := range holds {
		do := m.Replay
		switch h.Action {
		case actionDiscard:
			do = m.Discard
		case actionApplied:
			do = m.Applied
		}
		if _, err := do(ctx, h.OrderID, h.Version); err != nil && !errors.Is(err, shipment.ErrNoDeadLetter) {
			return done, fmt.Errorf("resume the release of order %s: %w", h.OrderID, err)
		}
		done++
	}
	return done, nil
}

// settle marks orderID releasing, runs act on the dead letter at version
// (none for actionApplied), deletes it, and releases the order.
func (m *Manager) settle(ctx context.Context, orderID string, version int64, action string, act func(shipment.Letter) error) (int, error) {
	s := m.cfg.Store
	id := key(orderID, version)
	var doc letterDoc
	err := s.letters.FindOne(ctx, byID(id)).Decode(&doc)
	found := err == nil
	if err != nil && !errors.Is(err, mongo.ErrNoDocuments) {
		return 0, fmt.Errorf("read dead letter %s: %w", id, err)
	}
	hold, err := s.Held(ctx, orderID)
	if err != nil {
		return 0, err
	}
	if !found && action != actionApplied && (hold == nil || hold.State != shipment.StateReleasing) {
		return 0, fmt.Errorf("%w: %s", shipment.ErrNoDeadLetter, id)
	}

	// Mark the release first: from now on no consumer parks behind this hold,
	// and a crash leaves a trace that the next call resumes from.
	token := newToken()
	if hold != nil || (found && doc.Holds) {
		h := holdDoc{OrderID: orderID, Version: version, State: shipment.StateReleasing, Action: action, Token: token, Since: time.Now().UTC()}
		if hold != nil {
			h.Since = hold.Since
		}
		if _, err := s.holds.ReplaceOne(ctx, byID(orderID), h, options.Replace().SetUpsert(true)); err != nil {
			return 0, fmt.Errorf("mark order %s releasing: %w", orderID, err)
		}
	}
	if found {
		if act != nil {
			if err := act(doc.letter()); err != nil {
				return 0, err
			}
		}
		// Unless it was dead-lettered again meanwhile (a replay that failed).
		if _, err := s.letters.DeleteOne(ctx, bson.D{{Key: "_id", Value: id}, {Key: "dead_lettered_at", Value: doc.DeadLetteredAt}}); err != nil {
			return 0, fmt.Errorf("delete dead letter %s: %w", id, err)
		}
	}

	released, err := m.releaseParked(ctx, orderID)
	if err != nil {
		return released, err
	}
	// Another dead letter of this order still holds it: the order stays held
	// behind that one (the released versions after it come back to a gap and
	// park again), unless the hold changed meanwhile.
	next, err := s.nextHolding(ctx, orderID)
	if err != nil {
		return released, err
	}
	if next != nil {
		h := holdDoc{OrderID: orderID, Version: next.Version, State: shipment.StateHeld, Token: newToken(), Since: next.DeadLetteredAt}
		if _, err := s.holds.ReplaceOne(ctx, bson.D{{Key: "_id", Value: orderID}, {Key: "token", Value: token}}, h); err != nil {
			return released, fmt.Errorf("hold order %s behind dead letter %s: %w", orderID, key(orderID, next.Version), err)
		}
		m.log.InfoContext(ctx, "order released, still held behind another dead letter", "aggregate_id", orderID,
			"version", version, "released", released, "dead_version", next.Version)
		return released, nil
	}
	res, err := s.holds.DeleteOne(ctx, bson.D{{Key: "_id", Value: orderID}, {Key: "token", Value: token}})
	if err != nil {
		return released, fmt.Errorf("delete hold of order %s: %w", orderID, err)
	}
	if res.DeletedCount == 1 {
		// A consumer that parked just before the release began re-reads the
		// hold and takes its message back; one that lost that race left it
		// here: release it too.
		n, err := m.releaseParked(ctx, orderID)
		released += n
		if err != nil {
			return released, err
		}
	}
	m.log.InfoContext(ctx, "order released", "aggregate_id", orderID, "version", version, "released", released, "resumed", !found)
	return released, nil
}

// releaseParked re-publishes orderID's parked messages in version order,
// deleting each after its confirm.
func (m *Manager) releaseParked(ctx context.Context, orderID string) (int, error) {
	ps, err := m.cfg.Store.parkedOf(ctx, orderID)
	if err != nil {
		return 0, err
	}
	for i, p := range ps {
		if err := m.cfg.Publisher.Publish(ctx, p.Message); err != nil {
			return i, fmt.Errorf("release %s: %w", key(p.OrderID, p.Version), err)
		}
		m.cfg.Crash.Hit(crashpoint.ShippingReleaseAfterPublish)
		if _, err := m.cfg.Store.Unpark(ctx, p.OrderID, p.Version); err != nil {
			return i, err
		}
	}
	return len(ps), nil
}

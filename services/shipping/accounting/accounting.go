// Package accounting tells the loss audit (cmd/audit, package
// internal/audit) what the shipping service did with the order events its
// inbox holds no done record of. Such an event is not lost when shipping
// kept it, or its effect:
//
//   - its effect is there (audit.KeptEffect): the shipment holds the event
//     at its version. Its inbox record is missing because the inbox buffers
//     records (INBOX_FLUSH_INTERVAL) and shipping died after the ack, before
//     writing it; or because the record expired.
//   - it is held (audit.KeptHeld): shipping dead-lettered it and keeps it
//     for an operator to replay or discard; or parked it behind an earlier
//     dead letter of its order; or an operator discarded its dead letter,
//     and its version is recorded as skipped in the shipment.
//
// The answers come from the stores that own those collections
// (internal/mongodb, internal/deadletter), looked up by order and version
// (the event's aggregate id and version), and count only when the message
// kept there is the event itself: its message id is the event's
// (its MessageID), not that of an event the database lost in a
// failover whose outbox id the new primary handed out again.
//
// It is the one package of the service outside internal/: cmd/audit, a
// command of its own, needs it.
package accounting

import (
	"context"
	"fmt"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
	"github.com/outbox-inbox/reference/services/shipping/internal/deadletter"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// DefaultMaxDeferralAge is how long, by default, shipping keeps deferring a
// message after its first deferral (its -max-deferral-age) before it
// dead-letters it: a message may be on its way that long and more, applied
// or held in the end, and an audit's grace must outlast it.
const DefaultMaxDeferralAge = shipment.DefaultMaxDeferralAge

// MaxEvents bounds one Account call.
const MaxEvents = min(mongodb.MaxLookup, deadletter.MaxLookup)

// Books reads shipping's stores in the database the service uses (the path
// of its MONGO_URI, "shipping" by default).
type Books struct {
	shipments *mongodb.Store
	letters   *deadletter.Store
}

var _ audit.Accountant = (*Books)(nil)

// New returns Books on db, with the service's collection names.
func New(db *mongo.Database) (*Books, error) {
	shipments, err := mongodb.New(db, "")
	if err != nil {
		return nil, fmt.Errorf("accounting: %w", err)
	}
	letters, err := deadletter.NewStore(db)
	if err != nil {
		return nil, fmt.Errorf("accounting: %w", err)
	}
	return &Books{shipments: shipments, letters: letters}, nil
}

// Account returns what shipping did with each of events it accounts for;
// the others are not in the result. At most MaxEvents at a time.
func (b *Books) Account(ctx context.Context, events []outboxaudit.LoggedEvent) (map[int64]audit.Kept, error) {
	if len(events) > MaxEvents {
		return nil, fmt.Errorf("accounting: %d events: at most %d at a time", len(events), MaxEvents)
	}
	refs := make([]shipment.VersionRef, len(events))
	for i, e := range events {
		refs[i] = shipment.VersionRef{OrderID: e.AggregateID, Version: e.AggregateVersion}
	}
	applied, err := b.shipments.Lookup(ctx, refs)
	if err != nil {
		return nil, fmt.Errorf("accounting: %w", err)
	}
	kept, err := b.letters.Lookup(ctx, refs)
	if err != nil {
		return nil, fmt.Errorf("accounting: %w", err)
	}
	out := make(map[int64]audit.Kept)
	for i, e := range events {
		if a, ok := applied[refs[i]]; ok && e.MessageID() == a.MessageID {
			out[e.ID] = audit.KeptEffect
			if a.Discarded {
				out[e.ID] = audit.KeptHeld
			}
			continue
		}
		if k, ok := kept[refs[i]]; ok && e.MessageID() == k.MessageID {
			out[e.ID] = audit.KeptHeld
		}
	}
	return out, nil
}

// MessageTime reads an event's creation time from its message id
// (outbox.MessageID): shipping's inbox's MessageTime, for its dedup horizon
// and its tallies.
func MessageTime(msgID string) (time.Time, bool) { return mongodb.MessageTime(msgID) }

package mongodb

import (
	"context"
	"fmt"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// MaxLookup bounds the versions of one Lookup.
const MaxLookup = 10_000

// Lookup returns what the shipments hold at each of refs that has an event
// (applied, or discarded by an operator), for the loss audit: a message the
// inbox holds no record of may still have its effect here (its record was
// buffered when shipping died, or expired), or have been discarded. One
// query, by _id.
func (s *Store) Lookup(ctx context.Context, refs []shipment.VersionRef) (map[shipment.VersionRef]shipment.Applied, error) {
	if len(refs) > MaxLookup {
		return nil, fmt.Errorf("look up %d shipment versions: at most %d", len(refs), MaxLookup)
	}
	out := make(map[shipment.VersionRef]shipment.Applied, len(refs))
	if len(refs) == 0 {
		return out, nil
	}
	ids := make([]string, len(refs))
	for i, r := range refs {
		ids[i] = key(r.OrderID, r.Version)
	}
	cur, err := s.events.Find(ctx, bson.D{{Key: "_id", Value: bson.D{{Key: "$in", Value: ids}}}},
		options.Find().SetProjection(bson.D{{Key: "created", Value: 0}, {Key: "cancelled", Value: 0}}))
	if err != nil {
		return nil, fmt.Errorf("look up %d shipment versions: %w", len(refs), err)
	}
	defer cur.Close(ctx)
	for cur.Next(ctx) {
		var r record
		if err := cur.Decode(&r); err != nil {
			return nil, fmt.Errorf("look up %d shipment versions: %w", len(refs), err)
		}
		out[shipment.VersionRef{OrderID: r.OrderID, Version: r.Version}] = shipment.Applied{
			MessageID: r.MessageID, EventType: r.EventType, Version: r.Version,
			AppliedAt: r.AppliedAt.Truncate(time.Millisecond), Discarded: r.Discarded,
		}
	}
	if err := cur.Err(); err != nil {
		return nil, fmt.Errorf("look up %d shipment versions: %w", len(refs), err)
	}
	return out, nil
}

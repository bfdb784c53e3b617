package deadletter

import (
	"context"
	"fmt"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// MaxLookup bounds the versions of one Lookup.
const MaxLookup = 10_000

// Kept is a message the store keeps at an order's version.
type Kept struct {
	MessageID string
	// Parked: parked behind an earlier dead letter of its order; otherwise
	// it is a dead letter itself.
	Parked bool
}

// Lookup returns the messages kept at each of refs that has one, a dead
// letter or a parked message, for the loss audit: neither has an inbox
// record, and neither is lost. Two queries, by _id.
func (s *Store) Lookup(ctx context.Context, refs []shipment.VersionRef) (map[shipment.VersionRef]Kept, error) {
	if len(refs) > MaxLookup {
		return nil, fmt.Errorf("look up %d dead-letter versions: at most %d", len(refs), MaxLookup)
	}
	out := make(map[shipment.VersionRef]Kept, len(refs))
	if len(refs) == 0 {
		return out, nil
	}
	ids := make([]string, len(refs))
	for i, r := range refs {
		ids[i] = key(r.OrderID, r.Version)
	}
	for _, c := range []struct {
		coll   *mongo.Collection
		parked bool
	}{{s.letters, false}, {s.parked, true}} {
		cur, err := c.coll.Find(ctx, bson.D{{Key: "_id", Value: bson.D{{Key: "$in", Value: ids}}}},
			options.Find().SetProjection(bson.D{{Key: "order_id", Value: 1}, {Key: "version", Value: 1}, {Key: "message.message_id", Value: 1}}))
		if err != nil {
			return nil, fmt.Errorf("look up %d versions in %s: %w", len(refs), c.coll.Name(), err)
		}
		var docs []struct {
			OrderID string `bson:"order_id"`
			Version int64  `bson:"version"`
			Message struct {
				MessageID string `bson:"message_id"`
			} `bson:"message"`
		}
		if err := cur.All(ctx, &docs); err != nil {
			return nil, fmt.Errorf("look up %d versions in %s: %w", len(refs), c.coll.Name(), err)
		}
		for _, d := range docs {
			ref := shipment.VersionRef{OrderID: d.OrderID, Version: d.Version}
			if _, dead := out[ref]; !dead || !c.parked { // a dead letter wins over a parked copy
				out[ref] = Kept{MessageID: d.Message.MessageID, Parked: c.parked}
			}
		}
	}
	return out, nil
}

// Package mongodb stores shipments in MongoDB (or FerretDB).
//
// A shipment is stored as one document per applied event, whose _id is
// "order id/version". Applying version v inserts that document after
// checking that v-1 is there: the unique _id makes each version apply once
// even on servers without transactions or atomic conditional updates
// (FerretDB), and versions only ever grow, so the check cannot go stale.
// Every lookup selects by _id alone, which FerretDB serves from its primary
// key.
package mongodb

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// DefaultCollection holds the applied events.
const DefaultCollection = "shipment_events"

// maxVersions bounds how many events Get reads for one order.
const maxVersions = 10_000

// Outcome of Apply.
type Outcome int

const (
	// Applied: the event was applied now.
	Applied Outcome = iota + 1
	// AlreadyApplied: the same message had been applied at that version.
	AlreadyApplied
)

// Store keeps shipments.
type Store struct {
	db     *mongo.Database
	events *mongo.Collection
}

// New returns a Store on db, using collection (DefaultCollection if empty).
func New(db *mongo.Database, collection string) (*Store, error) {
	if db == nil {
		return nil, errors.New("mongodb: nil database")
	}
	if collection == "" {
		collection = DefaultCollection
	}
	return &Store{db: db, events: db.Collection(collection)}, nil
}

// record is a stored event.
type record struct {
	ID        string              `bson:"_id"`
	OrderID   string              `bson:"order_id"`
	Version   int64               `bson:"version"`
	MessageID string              `bson:"message_id"`
	EventType string              `bson:"event_type"`
	AppliedAt time.Time           `bson:"applied_at"`
	Created   *shipment.Created   `bson:"created,omitempty"`
	Cancelled *shipment.Cancelled `bson:"cancelled,omitempty"`
}

func key(orderID string, version int64) string {
	return orderID + "/" + strconv.FormatInt(version, 10)
}

// Apply applies ev to its shipment. It returns shipment.ErrGap when the
// previous version is not applied yet, and shipment.ErrVersionConflict when a
// different message holds ev's version. Use the ctx the inbox hands the
// handler: in transaction mode it carries the session.
func (s *Store) Apply(ctx context.Context, ev shipment.Event) (Outcome, error) {
	if ev.Version > 1 {
		err := s.events.FindOne(ctx, bson.D{{Key: "_id", Value: key(ev.OrderID, ev.Version-1)}}).Err()
		if errors.Is(err, mongo.ErrNoDocuments) {
			return 0, fmt.Errorf("%w: order %s version %d waits for %d", shipment.ErrGap, ev.OrderID, ev.Version, ev.Version-1)
		}
		if err != nil {
			return 0, fmt.Errorf("read shipment %s version %d: %w", ev.OrderID, ev.Version-1, err)
		}
	}
	rec := record{
		ID:        key(ev.OrderID, ev.Version),
		OrderID:   ev.OrderID,
		Version:   ev.Version,
		MessageID: ev.MessageID,
		EventType: ev.Type,
		AppliedAt: time.Now().UTC(),
		Created:   ev.Created,
		Cancelled: ev.Cancelled,
	}
	_, err := s.events.InsertOne(ctx, rec)
	if err == nil {
		return Applied, nil
	}
	if !mongo.IsDuplicateKeyError(err) {
		return 0, fmt.Errorf("apply %s to shipment %s: %w", ev.Type, ev.OrderID, err)
	}
	var existing record
	if err := s.events.FindOne(ctx, bson.D{{Key: "_id", Value: rec.ID}}).Decode(&existing); err != nil {
		return 0, fmt.Errorf("read shipment %s version %d: %w", ev.OrderID, ev.Version, err)
	}
	if existing.MessageID != ev.MessageID {
		return 0, fmt.Errorf("%w: order %s version %d is message %s, not %s",
			shipment.ErrVersionConflict, ev.OrderID, ev.Version, existing.MessageID, ev.MessageID)
	}
	return AlreadyApplied, nil
}

// Get returns the shipment of orderID, or shipment.ErrNotFound.
func (s *Store) Get(ctx context.Context, orderID string) (shipment.Shipment, error) {
	var recs []shipment.Record
	for v := int64(1); v <= maxVersions; v++ {
		var r record
		err := s.events.FindOne(ctx, bson.D{{Key: "_id", Value: key(orderID, v)}}).Decode(&r)
		if errors.Is(err, mongo.ErrNoDocuments) {
			break
		}
		if err != nil {
			return shipment.Shipment{}, fmt.Errorf("read shipment %s version %d: %w", orderID, v, err)
		}
		recs = append(recs, shipment.Record{
			Applied:   shipment.Applied{MessageID: r.MessageID, EventType: r.EventType, Version: r.Version, AppliedAt: r.AppliedAt},
			Created:   r.Created,
			Cancelled: r.Cancelled,
		})
	}
	return shipment.Build(orderID, recs)
}

// Ping checks that the server answers.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.db.Client().Ping(ctx, nil); err != nil {
		return fmt.Errorf("ping MongoDB: %w", err)
	}
	return nil
}

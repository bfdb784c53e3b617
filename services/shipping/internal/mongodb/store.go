// Package mongodb stores shipments in MongoDB (or FerretDB).
//
// A shipment is stored as one document per applied event, whose _id is
// "order id/version". Applying version v reads v (already applied?), then
// inserts v: the unique _id makes each version apply once even on servers
// without transactions or atomic conditional updates (FerretDB). That v-1
// is applied first is the inbox's version gate's job (pkg/inbox, Gate),
// which runs Apply only then. Reading first keeps Apply correct inside a
// MongoDB transaction, where a write error aborts the transaction (see
// Apply). Event types the service
// ignores are stored too, without a payload, so the chain has no hole.
// Every lookup selects by _id alone, which FerretDB serves from its primary
// key.
//
// Each time Apply performs an event's effect for a message (applied now, or
// found already applied by that same message) it also appends an entry to
// the effect log (EffectLogCollection, see effectlog.go): the part of the
// effect that is not idempotent by itself, so that a message handled twice
// shows twice. The chaos suite's checker reads it as its witness of I2.
package mongodb

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/writeconcern"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// DefaultCollection holds the applied events.
const DefaultCollection = "shipment_events"

// maxVersions bounds how many events Get reads for one order.
const maxVersions = 10_000

// Store keeps shipments.
type Store struct {
	db     *mongo.Database
	events collection
	// effects is the effect log; writer names this process in its entries.
	effects inserter
	writer  Writer
}

// collection is the part of *mongo.Collection the store uses.
type collection interface {
	Find(ctx context.Context, filter any, opts ...options.Lister[options.FindOptions]) (*mongo.Cursor, error)
	FindOne(ctx context.Context, filter any, opts ...options.Lister[options.FindOneOptions]) *mongo.SingleResult
	InsertOne(ctx context.Context, document any, opts ...options.Lister[options.InsertOneOptions]) (*mongo.InsertOneResult, error)
}

// inserter is the part of *mongo.Collection the effect log uses.
type inserter interface {
	InsertOne(ctx context.Context, document any, opts ...options.Lister[options.InsertOneOptions]) (*mongo.InsertOneResult, error)
}

// New returns a Store on db, using collection (DefaultCollection if empty).
func New(db *mongo.Database, collection string) (*Store, error) {
	if db == nil {
		return nil, errors.New("mongodb: nil database")
	}
	if collection == "" {
		collection = DefaultCollection
	}
	// Journaled: without transactions the inbox may buffer the message's
	// record and the message is acked right after this write, so the write
	// itself must survive a mongod crash. Inside a transaction the driver
	// sends no write concern with it; the commit's (majority) applies.
	journaled := options.Collection().SetWriteConcern(writeconcern.Journaled())
	return &Store{
		db:      db,
		events:  db.Collection(collection, journaled),
		effects: db.Collection(EffectLogCollection, journaled),
		writer:  NewWriter(),
	}, nil
}

// record is a stored event.
type record struct {
	ID        string              `bson:"_id"`
	OrderID   string              `bson:"order_id"`
	Version   int64               `bson:"version"`
	MessageID string              `bson:"message_id"`
	EventType string              `bson:"event_type"`
	AppliedAt time.Time           `bson:"applied_at"`
	Discarded bool                `bson:"discarded,omitempty"`
	Created   *shipment.Created   `bson:"created,omitempty"`
	Cancelled *shipment.Cancelled `bson:"cancelled,omitempty"`
	Amended   *shipment.Amended   `bson:"amended,omitempty"`
}

func key(orderID string, version int64) string {
	return orderID + "/" + strconv.FormatInt(version, 10)
}

// Apply applies ev, carried by message messageID, to its shipment, whose
// previous version the caller's version gate found applied. It returns
// shipment.ErrVersionConflict when a different message holds ev's version.
// Use the ctx the inbox hands the handler: in transaction mode it carries
// the session.
//
// Apply reads before it writes: first ev's own version (applied already, by
// this message or by another), and inserts only when it is free. Inside a MongoDB transaction this order is required,
// not an optimisation: a write error (a duplicate key among them) aborts the
// transaction on the server, every later operation in it fails with
// NoSuchTransaction, so "insert, and read on a duplicate key" would turn an
// effect already there (applied in standalone mode, or whose inbox record
// expired) and every version conflict into a database failure. So in a
// transaction a write error is returned as it is, never recovered from; the
// snapshot the reads saw makes a concurrent insert of the same version a
// write conflict, which the inbox retries as a whole. Outside a transaction
// (standalone mode, FerretDB) a concurrent copy can still insert between the
// read and the write: there the unique _id settles it, and the duplicate key
// is read back as OutcomeAlreadyApplied or a conflict.
//
// Whenever the outcome is OutcomeApplied or OutcomeAlreadyApplied, Apply
// appends an entry to the effect log before it returns (with the same ctx:
// inside the transaction, when there is one); if that write fails, Apply
// fails and the inbox records nothing.
func (s *Store) Apply(ctx context.Context, messageID string, ev shipment.Event) (shipment.Outcome, error) {
	started := time.Now().UTC()
	o, err := s.apply(ctx, messageID, ev)
	if err != nil {
		return 0, err
	}
	if err := s.logEffect(ctx, messageID, ev, o, started); err != nil {
		return 0, err
	}
	return o, nil
}

// apply is Apply without the effect log.
func (s *Store) apply(ctx context.Context, messageID string, ev shipment.Event) (shipment.Outcome, error) {
	id := key(ev.OrderID, ev.Version)
	if o, err := s.existing(ctx, messageID, ev, id); o != 0 || err != nil {
		return o, err
	}
	rec := record{
		ID:        id,
		OrderID:   ev.OrderID,
		Version:   ev.Version,
		MessageID: messageID,
		EventType: ev.Type,
		AppliedAt: time.Now().UTC(),
		Created:   ev.Created,
		Cancelled: ev.Cancelled,
		Amended:   ev.Amended,
	}
	_, err := s.events.InsertOne(ctx, rec)
	if err == nil {
		return shipment.OutcomeApplied, nil
	}
	if !mongo.IsDuplicateKeyError(err) || mongo.SessionFromContext(ctx) != nil {
		return 0, fmt.Errorf("apply %s to shipment %s version %d: %w", ev.Type, ev.OrderID, ev.Version, err)
	}
	// A concurrent copy won the insert (no transaction: nothing aborted).
	o, err := s.existing(ctx, messageID, ev, id)
	if err == nil && o == 0 {
		err = fmt.Errorf("apply %s to shipment %s version %d: duplicate key, and no document", ev.Type, ev.OrderID, ev.Version)
	}
	return o, err
}

// existing reports whether ev's version is applied: OutcomeAlreadyApplied by
// message messageID, shipment.ErrVersionConflict by another, 0 when it is
// not.
func (s *Store) existing(ctx context.Context, messageID string, ev shipment.Event, id string) (shipment.Outcome, error) {
	var r record
	err := s.events.FindOne(ctx, bson.D{{Key: "_id", Value: id}}).Decode(&r)
	switch {
	case errors.Is(err, mongo.ErrNoDocuments):
		return 0, nil
	case err != nil:
		return 0, fmt.Errorf("read shipment %s version %d: %w", ev.OrderID, ev.Version, err)
	case r.MessageID != messageID:
		return 0, fmt.Errorf("%w: order %s version %d is message %s, not %s",
			shipment.ErrVersionConflict, ev.OrderID, ev.Version, r.MessageID, messageID)
	default:
		return shipment.OutcomeAlreadyApplied, nil
	}
}

// Skip records version of orderID as discarded by an operator: it counts in
// the chain, with no effect. A version already there (applied, or skipped
// before) is left as it is. The inbox's gate must pass it too (Gate.Skip,
// after this) for the versions after it to apply.
func (s *Store) Skip(ctx context.Context, orderID string, version int64, messageID, eventType string) error {
	rec := record{
		ID: key(orderID, version), OrderID: orderID, Version: version, MessageID: messageID,
		EventType: eventType, AppliedAt: time.Now().UTC(), Discarded: true,
	}
	if _, err := s.events.InsertOne(ctx, rec); err != nil && !mongo.IsDuplicateKeyError(err) {
		return fmt.Errorf("skip shipment %s version %d: %w", orderID, version, err)
	}
	return nil
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
			Applied: shipment.Applied{MessageID: r.MessageID, EventType: r.EventType, Version: r.Version,
				AppliedAt: r.AppliedAt, Discarded: r.Discarded},
			Created:   r.Created,
			Cancelled: r.Cancelled,
			Amended:   r.Amended,
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

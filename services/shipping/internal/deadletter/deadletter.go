// Package deadletter keeps the shipping service's dead letters, and the
// messages parked behind them, in MongoDB (Store), so that a dead letter
// holds back only the later versions of its own order, and releases them
// (Manager): an operator can replay or discard it and release what it
// held, in order, re-published through a Publisher. The types it keeps are
// the domain's (shipment.Letter, Hold, Parked).
//
// Versions of an order apply one after the other. When version v of an
// order is dead-lettered (its handler kept failing, its payload is
// malformed, its predecessor never came), every later version of that order
// would wait for v in the delay queue until it too is dead-lettered. Instead:
//
//   - the dead letter is recorded (collection dead_letters, _id "order/v",
//     with the message's body and headers) and, unless its version is
//     applied anyway (a version conflict), the order is held (collection
//     held_orders, _id the order id, with its earliest holding dead
//     version: a later dead letter of the same order does not move it);
//   - a later version of a held order that finds its predecessor missing is
//     parked at once (collection parked, _id "order/version", with the
//     message) and acked; other orders flow;
//   - Replay re-publishes the dead letter to the consumer's queue (after a
//     fix), Discard records its version as skipped in the shipment; both then
//     release the order: its parked messages are re-published in version
//     order and the hold is removed, or, while another dead letter of the
//     order still holds it, moved to that one (the released versions after
//     it find their gap again and park again).
//   - Applied does the same when the held version applies after all (a
//     second copy of it, or the redelivery of a message whose dead letter
//     was recorded but not published): its dead letter is dropped and the
//     order released, with no operator.
//
// A release is idempotent and resumable: the hold is first marked
// "releasing" with a token; each parked message is deleted only after its
// re-publish was confirmed; the hold is deleted last, and only if it still
// carries the token (a replayed message that fails again holds the order
// anew). A crash in the middle leaves the hold "releasing", with the action
// asked: running Replay or Discard again for that order, or Resume (the
// service calls it at start), finishes it. A message re-published twice
// is a duplicate, which the inbox absorbs; order is kept by the consumer's
// version gate (pkg/inbox), which never applies a version before its predecessor.
//
// A consumer that parks a message re-reads the hold afterwards: if a
// release began meanwhile, it takes its message back (or finds the release
// already re-published it), so no message is parked behind a hold that is
// gone.
//
// A kept message's headers are stored as an array of typed {k, t, v}
// entries (Headers): any AMQP key survives, '.' and a leading '$' included,
// and a replay sends each value with its AMQP type (timestamps, byte
// strings, tables, arrays, every integer width).
//
// Lookups are by _id, except the listings: List, Stats, the releases a
// start resumes, and a release's parked messages and remaining dead letters
// of one order. EnsureIndexes (at start) creates the indexes they use, and
// none of them reads a message's body or headers but a release, which
// re-publishes them: List reads each collection once, whatever the number
// of held orders, and counts the parked messages without their bodies.
package deadletter

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/readpref"
	"go.mongodb.org/mongo-driver/v2/mongo/writeconcern"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// Collection names.
const (
	LettersCollection = "dead_letters"
	HoldsCollection   = "held_orders"
	ParkedCollection  = "parked"
)

// messageDoc is a shipment.KeptMessage as stored: its headers as Headers.
type messageDoc struct {
	MessageID   string  `bson:"message_id"`
	Type        string  `bson:"type,omitempty"`
	ContentType string  `bson:"content_type,omitempty"`
	RoutingKey  string  `bson:"routing_key"` // as first published
	Headers     Headers `bson:"headers,omitempty"`
	Body        []byte  `bson:"body"`
	// BodyOmitted is the size of a body too large to keep (over
	// MaxKeptBodyBytes), which Body then lacks.
	BodyOmitted int `bson:"body_omitted,omitempty"`
}

func messageOf(m shipment.KeptMessage) messageDoc {
	return messageDoc{MessageID: m.MessageID, Type: m.Type, ContentType: m.ContentType, RoutingKey: m.RoutingKey,
		Headers: Headers(m.Headers), Body: m.Body, BodyOmitted: m.BodyOmitted}
}

func (m messageDoc) kept() shipment.KeptMessage {
	return shipment.KeptMessage{MessageID: m.MessageID, Type: m.Type, ContentType: m.ContentType, RoutingKey: m.RoutingKey,
		Headers: map[string]any(m.Headers), Body: m.Body, BodyOmitted: m.BodyOmitted}
}

// MaxKeptBodyBytes bounds the body a dead letter keeps: a MongoDB document
// holds at most 16 MiB, headers and the letter's other fields included, and
// a dead letter that cannot be recorded would keep its delivery, redelivered
// for ever. A larger body is left out (shipment.KeptMessage.BodyOmitted).
const MaxKeptBodyBytes = 15 << 20

// letterDoc is a shipment.Letter as stored, _id "order/version".
type letterDoc struct {
	ID                string     `bson:"_id"`
	OrderID           string     `bson:"order_id"`
	Version           int64      `bson:"version"`
	EventType         string     `bson:"event_type"`
	Reason            string     `bson:"reason"`
	Error             string     `bson:"error"`
	Holds             bool       `bson:"holds"`
	AwaitsPredecessor bool       `bson:"awaits_predecessor,omitempty"`
	DeadLetteredAt    time.Time  `bson:"dead_lettered_at"`
	Message           messageDoc `bson:"message"`
}

func letterDocOf(l shipment.Letter) letterDoc {
	return letterDoc{ID: key(l.OrderID, l.Version), OrderID: l.OrderID, Version: l.Version, EventType: l.EventType,
		Reason: l.Reason, Error: l.Error, Holds: l.Holds, AwaitsPredecessor: l.AwaitsPredecessor,
		DeadLetteredAt: l.DeadLetteredAt, Message: messageOf(l.Message)}
}

func (d letterDoc) letter() shipment.Letter {
	return shipment.Letter{OrderID: d.OrderID, Version: d.Version, EventType: d.EventType, Reason: d.Reason,
		Error: d.Error, Holds: d.Holds, AwaitsPredecessor: d.AwaitsPredecessor, DeadLetteredAt: d.DeadLetteredAt,
		Message: d.Message.kept()}
}

// holdDoc is a shipment.Hold as stored, _id the order id.
type holdDoc struct {
	OrderID string    `bson:"_id"`
	Version int64     `bson:"version"`
	State   string    `bson:"state"`
	Action  string    `bson:"action,omitempty"`
	Token   string    `bson:"token"`
	Since   time.Time `bson:"since"`
}

func holdDocOf(h shipment.Hold) holdDoc {
	return holdDoc{OrderID: h.OrderID, Version: h.Version, State: h.State, Action: h.Action, Token: h.Token, Since: h.Since}
}

func (d holdDoc) hold() shipment.Hold {
	return shipment.Hold{OrderID: d.OrderID, Version: d.Version, State: d.State, Action: d.Action, Token: d.Token, Since: d.Since}
}

// parkedDoc is a shipment.Parked as stored, _id "order/version".
type parkedDoc struct {
	ID       string     `bson:"_id"`
	OrderID  string     `bson:"order_id"`
	Version  int64      `bson:"version"`
	ParkedAt time.Time  `bson:"parked_at"`
	Message  messageDoc `bson:"message"`
}

func (d parkedDoc) parked() shipment.Parked {
	return shipment.Parked{OrderID: d.OrderID, Version: d.Version, ParkedAt: d.ParkedAt, Message: d.Message.kept()}
}

// Store keeps dead letters, holds and parked messages in MongoDB.
type Store struct {
	letters, holds, parked *mongo.Collection
}

// NewStore returns a Store on db.
func NewStore(db *mongo.Database) (*Store, error) {
	if db == nil {
		return nil, errors.New("deadletter: nil database")
	}
	// A parked message is acked once parked, so the parked copy is its only
	// one: it is written to a majority (it survives a failover) and to the
	// journal (on a standalone mongod a plain write is acknowledged before
	// its journal commit, and a crash then would lose it), and read from the
	// primary, whatever MONGO_URI or the server's defaults say, as the inbox
	// does. Dead letters and holds are written and read the same way.
	j := options.Collection().SetWriteConcern(&writeconcern.WriteConcern{W: "majority", Journal: &journaled}).
		SetReadPreference(readpref.Primary())
	return &Store{
		letters: db.Collection(LettersCollection, j),
		holds:   db.Collection(HoldsCollection, j),
		parked:  db.Collection(ParkedCollection, j),
	}, nil
}

var journaled = true

func key(orderID string, version int64) string { return orderID + "/" + strconv.FormatInt(version, 10) }

func byID(id string) bson.D { return bson.D{{Key: "_id", Value: id}} }

func newToken() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Record records a dead letter (replacing an earlier one at the same order
// and version) and, when it holds its order, holds it.
func (s *Store) Record(ctx context.Context, l shipment.Letter) error {
	id := key(l.OrderID, l.Version)
	if n := len(l.Message.Body); n > MaxKeptBodyBytes {
		l.Message.Body, l.Message.BodyOmitted = nil, n
	}
	if _, err := s.letters.ReplaceOne(ctx, byID(id), letterDocOf(l), options.Replace().SetUpsert(true)); err != nil {
		return fmt.Errorf("record dead letter %s: %w", id, err)
	}
	if !l.Holds {
		return nil
	}
	// The hold stays at the order's earliest dead version: a later dead
	// letter (a malformed message parked behind it would not be, but one
	// dead-lettered by itself is) must not let the versions between them
	// through. A release in progress is replaced: its order is held anew.
	cur, err := s.Held(ctx, l.OrderID)
	if err != nil {
		return fmt.Errorf("hold order %s behind dead letter %s: %w", l.OrderID, id, err)
	}
	if cur != nil && cur.State == shipment.StateHeld && cur.Version < l.Version {
		return nil
	}
	h := holdDoc{OrderID: l.OrderID, Version: l.Version, State: shipment.StateHeld, Token: newToken(), Since: l.DeadLetteredAt}
	if _, err := s.holds.ReplaceOne(ctx, byID(l.OrderID), h, options.Replace().SetUpsert(true)); err != nil {
		return fmt.Errorf("hold order %s behind dead letter %s: %w", l.OrderID, id, err)
	}
	return nil
}

// letter returns the dead letter at orderID/version, or nil.
func (s *Store) letter(ctx context.Context, orderID string, version int64) (*shipment.Letter, error) {
	var doc letterDoc
	err := s.letters.FindOne(ctx, byID(key(orderID, version)), options.FindOne().
		SetProjection(bson.D{{Key: "message.body", Value: 0}, {Key: "message.headers", Value: 0}})).Decode(&doc)
	if errors.Is(err, mongo.ErrNoDocuments) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read dead letter %s: %w", key(orderID, version), err)
	}
	l := doc.letter()
	return &l, nil
}

// Held returns orderID's hold, or nil.
func (s *Store) Held(ctx context.Context, orderID string) (*shipment.Hold, error) {
	var doc holdDoc
	err := s.holds.FindOne(ctx, byID(orderID)).Decode(&doc)
	if errors.Is(err, mongo.ErrNoDocuments) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read hold of order %s: %w", orderID, err)
	}
	h := doc.hold()
	return &h, nil
}

// Park parks p. Parking the same message twice is a no-op; another message
// parked at its order and version is a shipment.ErrParkedConflict.
func (s *Store) Park(ctx context.Context, p shipment.Parked) error {
	id := key(p.OrderID, p.Version)
	_, err := s.parked.InsertOne(ctx, parkedDoc{ID: id, OrderID: p.OrderID, Version: p.Version, ParkedAt: p.ParkedAt, Message: messageOf(p.Message)})
	if err == nil {
		return nil
	}
	if !mongo.IsDuplicateKeyError(err) {
		return fmt.Errorf("park %s: %w", id, err)
	}
	var existing parkedDoc
	if err := s.parked.FindOne(ctx, byID(id)).Decode(&existing); err != nil {
		if errors.Is(err, mongo.ErrNoDocuments) { // released meanwhile: park again
			return s.Park(ctx, p)
		}
		return fmt.Errorf("read parked %s: %w", id, err)
	}
	if existing.Message.MessageID != p.Message.MessageID {
		return fmt.Errorf("%w: %s holds message %s, not %s", shipment.ErrParkedConflict, id, existing.Message.MessageID, p.Message.MessageID)
	}
	return nil
}

// Unpark deletes the parked message at orderID/version, reporting whether
// it was there.
func (s *Store) Unpark(ctx context.Context, orderID string, version int64) (bool, error) {
	res, err := s.parked.DeleteOne(ctx, byID(key(orderID, version)))
	if err != nil {
		return false, fmt.Errorf("unpark %s: %w", key(orderID, version), err)
	}
	return res.DeletedCount > 0, nil
}

// nextHolding returns orderID's dead letter of the lowest version that
// holds its order, or nil.
func (s *Store) nextHolding(ctx context.Context, orderID string) (*shipment.Letter, error) {
	var doc letterDoc
	err := s.letters.FindOne(ctx, bson.D{{Key: "order_id", Value: orderID}, {Key: "holds", Value: true}},
		options.FindOne().SetSort(bson.D{{Key: "version", Value: 1}})).Decode(&doc)
	if errors.Is(err, mongo.ErrNoDocuments) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("find the dead letters holding order %s: %w", orderID, err)
	}
	l := doc.letter()
	return &l, nil
}

// parkedOf returns orderID's parked messages in version order.
func (s *Store) parkedOf(ctx context.Context, orderID string) ([]shipment.Parked, error) {
	cur, err := s.parked.Find(ctx, bson.D{{Key: "order_id", Value: orderID}}, options.Find().SetSort(bson.D{{Key: "version", Value: 1}}))
	if err != nil {
		return nil, fmt.Errorf("list parked messages of order %s: %w", orderID, err)
	}
	var docs []parkedDoc
	if err := cur.All(ctx, &docs); err != nil {
		return nil, fmt.Errorf("list parked messages of order %s: %w", orderID, err)
	}
	out := make([]shipment.Parked, len(docs))
	for i, d := range docs {
		out[i] = d.parked()
	}
	return out, nil
}

// EnsureIndexes creates the indexes of the listings: dead letters by order
// (a release's next holding letter) and by time (List), parked messages by
// order (a release, List's counts) and by time (Stats), holds by state (the
// releases to resume). Safe to call at every start.
func (s *Store) EnsureIndexes(ctx context.Context) error {
	for _, ix := range []struct {
		coll *mongo.Collection
		keys bson.D
	}{
		{s.letters, bson.D{{Key: "order_id", Value: 1}, {Key: "holds", Value: 1}, {Key: "version", Value: 1}}},
		{s.letters, bson.D{{Key: "dead_lettered_at", Value: 1}}},
		{s.parked, bson.D{{Key: "order_id", Value: 1}, {Key: "version", Value: 1}}},
		{s.parked, bson.D{{Key: "order_id", Value: 1}, {Key: "parked_at", Value: 1}}},
		{s.parked, bson.D{{Key: "parked_at", Value: 1}}},
		{s.holds, bson.D{{Key: "state", Value: 1}}},
	} {
		if _, err := ix.coll.Indexes().CreateOne(ctx, mongo.IndexModel{Keys: ix.keys}); err != nil {
			return fmt.Errorf("create index %v on %s: %w", ix.keys, ix.coll.Name(), err)
		}
	}
	return nil
}

// Stats is what the metrics show.
type Stats struct {
	HeldOrders      int
	DeadLetters     int
	Parked          int
	OldestParkedAge time.Duration // 0 when nothing is parked
}

// Stats counts holds, dead letters and parked messages.
func (s *Store) Stats(ctx context.Context, now time.Time) (Stats, error) {
	var st Stats
	n, err := s.holds.CountDocuments(ctx, bson.D{})
	if err != nil {
		return st, fmt.Errorf("count held orders: %w", err)
	}
	st.HeldOrders = int(n)
	if n, err = s.letters.CountDocuments(ctx, bson.D{}); err != nil {
		return st, fmt.Errorf("count dead letters: %w", err)
	}
	st.DeadLetters = int(n)
	if n, err = s.parked.CountDocuments(ctx, bson.D{}); err != nil {
		return st, fmt.Errorf("count parked messages: %w", err)
	}
	st.Parked = int(n)
	if n > 0 {
		var oldest struct {
			ParkedAt time.Time `bson:"parked_at"`
		}
		err := s.parked.FindOne(ctx, bson.D{}, options.FindOne().SetSort(bson.D{{Key: "parked_at", Value: 1}}).
			SetProjection(bson.D{{Key: "_id", Value: 0}, {Key: "parked_at", Value: 1}})).Decode(&oldest)
		if err != nil && !errors.Is(err, mongo.ErrNoDocuments) {
			return st, fmt.Errorf("oldest parked message: %w", err)
		}
		if err == nil {
			st.OldestParkedAge = max(0, now.Sub(oldest.ParkedAt))
		}
	}
	return st, nil
}

// List returns every dead letter (oldest first, without its message's body
// and headers) and every held order, with its parked messages counted.
func (s *Store) List(ctx context.Context) ([]shipment.Letter, []shipment.Hold, error) {
	cur, err := s.letters.Find(ctx, bson.D{}, options.Find().SetSort(bson.D{{Key: "dead_lettered_at", Value: 1}}).
		SetProjection(bson.D{{Key: "message.body", Value: 0}, {Key: "message.headers", Value: 0}}))
	if err != nil {
		return nil, nil, fmt.Errorf("list dead letters: %w", err)
	}
	var docs []letterDoc
	if err := cur.All(ctx, &docs); err != nil {
		return nil, nil, fmt.Errorf("list dead letters: %w", err)
	}
	letters := make([]shipment.Letter, len(docs))
	for i, d := range docs {
		letters[i] = d.letter()
	}
	cur, err = s.holds.Find(ctx, bson.D{}, options.Find().SetSort(bson.D{{Key: "since", Value: 1}}))
	if err != nil {
		return nil, nil, fmt.Errorf("list held orders: %w", err)
	}
	holds, err := allHolds(ctx, cur)
	if err != nil {
		return nil, nil, fmt.Errorf("list held orders: %w", err)
	}
	if err := s.countParked(ctx, holds); err != nil {
		return nil, nil, err
	}
	return letters, holds, nil
}

// countParked fills the holds' Parked and OldestParkedAt, in one read of
// the parked messages' order and time only (an index covers it on MongoDB).
func (s *Store) countParked(ctx context.Context, holds []shipment.Hold) error {
	if len(holds) == 0 {
		return nil
	}
	byOrder := make(map[string]*shipment.Hold, len(holds))
	ids := make(bson.A, 0, len(holds))
	for i := range holds {
		byOrder[holds[i].OrderID] = &holds[i]
		ids = append(ids, holds[i].OrderID)
	}
	cur, err := s.parked.Find(ctx, bson.D{{Key: "order_id", Value: bson.D{{Key: "$in", Value: ids}}}},
		options.Find().SetProjection(bson.D{{Key: "_id", Value: 0}, {Key: "order_id", Value: 1}, {Key: "parked_at", Value: 1}}))
	if err != nil {
		return fmt.Errorf("count parked messages: %w", err)
	}
	defer cur.Close(ctx)
	for cur.Next(ctx) {
		var p struct {
			OrderID  string    `bson:"order_id"`
			ParkedAt time.Time `bson:"parked_at"`
		}
		if err := cur.Decode(&p); err != nil {
			return fmt.Errorf("count parked messages: %w", err)
		}
		h := byOrder[p.OrderID]
		if h == nil {
			continue
		}
		h.Parked++
		if h.OldestParkedAt == nil || p.ParkedAt.Before(*h.OldestParkedAt) {
			at := p.ParkedAt
			h.OldestParkedAt = &at
		}
	}
	if err := cur.Err(); err != nil {
		return fmt.Errorf("count parked messages: %w", err)
	}
	return nil
}

// releasing returns the holds whose release was interrupted.
func (s *Store) releasing(ctx context.Context) ([]shipment.Hold, error) {
	cur, err := s.holds.Find(ctx, bson.D{{Key: "state", Value: shipment.StateReleasing}})
	if err != nil {
		return nil, fmt.Errorf("list releasing holds: %w", err)
	}
	out, err := allHolds(ctx, cur)
	if err != nil {
		return nil, fmt.Errorf("list releasing holds: %w", err)
	}
	return out, nil
}

// allHolds reads cur's holds (never nil: a listing of none is []).
func allHolds(ctx context.Context, cur *mongo.Cursor) ([]shipment.Hold, error) {
	var docs []holdDoc
	if err := cur.All(ctx, &docs); err != nil {
		return nil, err
	}
	out := make([]shipment.Hold, len(docs))
	for i, d := range docs {
		out[i] = d.hold()
	}
	return out, nil
}

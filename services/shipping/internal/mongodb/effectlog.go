package mongodb

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"strconv"
	"time"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// EffectLogCollection holds the effect log: one entry, with an id of its
// own, each time Apply performed an event's effect for a message.
//
// The shipment documents are idempotent on their own key (order/version):
// a message applied twice leaves one document, so they cannot show whether
// the inbox deduplicated. The effect log is the opposite, append-only, and
// is written in the same inbox unit as the shipment: a second run of the
// handler for a message the inbox should have skipped is a second entry.
//
//   - Transaction mode (a replica set): the entry commits with the shipment
//     and the inbox record, so a message has exactly one entry, whatever
//     crashed or was delivered again.
//   - Standalone mode (FerretDB, a standalone mongod): the inbox checks its
//     record, runs the handler, then records the message. A handler run
//     again for the same message (a crash after the effect and before the
//     record was written, a buffered record lost with its process, the
//     record's write cut by a MongoDB fault, a handler cancelled after its
//     writes landed because the consumer's broker session ended, two
//     consumers handling copies of one message before either record was
//     written) finds its version
//     already applied and leaves the shipment alone, but appends a second
//     entry. That entry is the non-idempotent part of the effect: code that
//     copies this service and does something that is not idempotent in the
//     handler (an e-mail, a counter, an append) gets it twice in these same
//     cases, and must guard it by a key of its own or run in transaction
//     mode.
//
// Entries are never updated or deleted by the service.
const EffectLogCollection = "shipment_effect_log"

// Outcomes of an effect log entry.
const (
	// EffectApplied: the shipment's version was written by this run.
	EffectApplied = "applied"
	// EffectAlreadyApplied: the version already held this message; the run
	// changed no shipment (a duplicate the inbox let through).
	EffectAlreadyApplied = "already_applied"
)

// EffectLogEntry is one entry of the effect log.
type EffectLogEntry struct {
	ID        bson.ObjectID `bson:"_id"`
	MessageID string        `bson:"message_id"`
	OrderID   string        `bson:"order_id"`
	Version   int64         `bson:"version"`
	EventType string        `bson:"event_type"`
	// Outcome is EffectApplied or EffectAlreadyApplied.
	Outcome string `bson:"outcome"`
	// StartedAt is when Apply began (after the inbox's check); At is when
	// the entry was written, after the shipment's write or read.
	StartedAt time.Time `bson:"started_at"`
	At        time.Time `bson:"at"`
	// Writer is the process that wrote the entry (Writer.String).
	Writer string `bson:"writer"`
}

// Writer identifies a process writing effect log entries: a random
// instance id drawn at start, and the process id. The service logs it at
// start, so a supervisor can tell which of its process runs wrote an entry.
type Writer struct {
	Instance string
	PID      int
}

// NewWriter returns a Writer for this process with a fresh instance id.
func NewWriter() Writer {
	return Writer{Instance: rand.Text()[:16], PID: os.Getpid()}
}

// String is the writer as entries carry it: "instance/pid".
func (w Writer) String() string { return w.Instance + "/" + strconv.Itoa(w.PID) }

// Writer returns the identity s writes effect log entries under.
func (s *Store) Writer() Writer { return s.writer }

// logEffect appends the entry of ev's effect for messageID.
func (s *Store) logEffect(ctx context.Context, messageID string, ev shipment.Event, o shipment.Outcome, started time.Time) error {
	outcome := EffectApplied
	if o == shipment.OutcomeAlreadyApplied {
		outcome = EffectAlreadyApplied
	}
	e := EffectLogEntry{
		ID: bson.NewObjectID(), MessageID: messageID, OrderID: ev.OrderID, Version: ev.Version, EventType: ev.Type,
		Outcome: outcome, StartedAt: started, At: time.Now().UTC(), Writer: s.writer.String(),
	}
	if _, err := s.effects.InsertOne(ctx, e); err != nil {
		return fmt.Errorf("log the effect of %s on shipment %s version %d: %w", ev.Type, ev.OrderID, ev.Version, err)
	}
	return nil
}

// EffectLog returns the effect log's entries for messageID, in the order
// they were written (by At; ties by id).
// It reads the whole collection on FerretDB (the filter is not on _id):
// for tests and audits, not for the message path.
func (s *Store) EffectLog(ctx context.Context, messageID string) ([]EffectLogEntry, error) {
	cur, err := s.db.Collection(EffectLogCollection).Find(ctx, bson.D{{Key: "message_id", Value: messageID}},
		options.Find().SetSort(bson.D{{Key: "at", Value: 1}, {Key: "_id", Value: 1}}))
	if err != nil {
		return nil, fmt.Errorf("read the effect log of message %s: %w", messageID, err)
	}
	var out []EffectLogEntry
	if err := cur.All(ctx, &out); err != nil {
		return nil, fmt.Errorf("read the effect log of message %s: %w", messageID, err)
	}
	return out, nil
}

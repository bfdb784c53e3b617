package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.mongodb.org/mongo-driver/v2/bson"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/mongo/writeconcern"
)

// Position is where a message stands in the history of the aggregate it
// changes: the aggregate's id and the message's version there. The producer
// numbers an aggregate's messages FirstVersion, FirstVersion+1, ... without
// gaps (pkg/outbox's aggregate_version header does).
type Position struct {
	Aggregate string
	Version   int64
}

func (p Position) String() string {
	return p.Aggregate + " version " + strconv.FormatInt(p.Version, 10)
}

var (
	// ErrGap is matched (errors.Is) by the *GapError the Gate returns when
	// the version before the message's is not applied yet. Nothing ran and
	// nothing was recorded: redeliver the message later (a delay queue),
	// bounded, then dead-letter or park it.
	ErrGap = errors.New("inbox: the previous version is not applied yet")
	// ErrVersionConflict is matched by the *ConflictError the Gate returns
	// when another message holds the message's version: the producer gave
	// two messages one version. It needs a human (dead-letter it).
	ErrVersionConflict = errors.New("inbox: another message holds this version")
	// ErrInvalidPosition: an empty, oversized or non-UTF-8 aggregate id, or
	// a version below the gate's FirstVersion. Nothing ran (dead-letter it).
	ErrInvalidPosition = errors.New("inbox: invalid position")
)

// GapError says that a message waits for version Position.Version-1 of its
// aggregate.
type GapError struct {
	MessageID string
	Position  Position
}

func (e *GapError) Error() string {
	return fmt.Sprintf("inbox: message %s (%s) waits for version %d", e.MessageID, e.Position, e.Position.Version-1)
}

// Is makes errors.Is(err, ErrGap) true.
func (e *GapError) Is(target error) bool { return target == ErrGap }

// ConflictError says which message holds the version.
type ConflictError struct {
	MessageID string
	Position  Position
	// HeldBy is the message applied at Position.
	HeldBy string
}

func (e *ConflictError) Error() string {
	return fmt.Sprintf("inbox: message %s: %s is held by message %s", e.MessageID, e.Position, e.HeldBy)
}

// Is makes errors.Is(err, ErrVersionConflict) true.
func (e *ConflictError) Is(target error) bool { return target == ErrVersionConflict }

// GateConfig configures a Gate.
type GateConfig struct {
	// Collection holds the gate's marks. Default: DefaultGateCollection.
	Collection string
	// FirstVersion is the version that starts an aggregate's chain: it
	// applies without a predecessor; a lower version is refused
	// (ErrInvalidPosition). Default: 1.
	FirstVersion int64
}

// DefaultGateCollection is GateConfig.Collection's default.
const DefaultGateCollection = "inbox_gate"

// maxAggregateLen bounds a Position's aggregate id, in bytes.
const maxAggregateLen = 512

// Gate applies each aggregate's messages in version order through an Inbox:
// version n runs its handler only once n-1 was applied, whatever order the
// broker delivers them in. See the package documentation, "Version order".
// It is safe for concurrent use.
type Gate struct {
	in    *Inbox
	coll  *mongo.Collection
	first int64
}

// NewGate returns a Gate deduplicating through in and keeping its marks in
// in's database. It does not talk to the server.
func NewGate(in *Inbox, cfg GateConfig) (*Gate, error) {
	if in == nil {
		return nil, errors.New("inbox: nil Inbox")
	}
	coll := cmp.Or(cfg.Collection, DefaultGateCollection)
	if err := validCollection(coll); err != nil {
		return nil, fmt.Errorf("inbox: GateConfig.Collection %q: %w", coll, err)
	}
	if coll == in.coll.Name() {
		return nil, fmt.Errorf("inbox: GateConfig.Collection %q is the inbox's own collection", coll)
	}
	if cfg.FirstVersion < 0 {
		return nil, fmt.Errorf("inbox: GateConfig.FirstVersion %d: want 0 (for 1) or more", cfg.FirstVersion)
	}
	return &Gate{
		in: in,
		// Journaled, as the inbox's records: see "Durability".
		coll:  in.db.Collection(coll, options.Collection().SetWriteConcern(writeconcern.Journaled())),
		first: cmp.Or(cfg.FirstVersion, 1),
	}, nil
}

// Collection returns the collection holding the marks.
func (g *Gate) Collection() *mongo.Collection { return g.coll }

// Process runs handler for the message msgID at pos, through the Inbox,
// unless the message is recorded already, and only once the version before
// pos is applied. It returns what Inbox.Process returns, and:
//
//   - AlreadyApplied: the gate has pos applied by this message, but the
//     inbox had no record of it (a crash between the two, or an expired
//     record). The handler did not run; the message is recorded now.
//   - a *GapError (ErrGap): the previous version is not applied; nothing
//     ran or was recorded. Redeliver later, bounded.
//   - a *ConflictError (ErrVersionConflict): another message holds pos.
//     Without transactions, one that raced this message to pos: both
//     handlers may have run.
//   - ErrInvalidPosition: nothing ran.
//
// Acknowledge the message only after Processed, Duplicate or AlreadyApplied.
func (g *Gate) Process(ctx context.Context, msgID string, pos Position, handler Handler) (Result, error) {
	if err := g.validPosition(pos); err != nil {
		return 0, err
	}
	if handler == nil {
		return 0, errors.New("inbox: nil handler")
	}
	var already bool
	gated := func(ctx context.Context) error {
		already = false
		held, err := g.holder(ctx, pos.Aggregate, pos.Version)
		switch {
		case err != nil:
			return &gateRefusal{err}
		case held == msgID && !mutantInboxNoDedup:
			already = true
			return nil // records the message
		case held == msgID: // a planted bug: see mutant_inbox_nodedup.go
		case held != "":
			return &gateRefusal{&ConflictError{MessageID: msgID, Position: pos, HeldBy: held}}
		}
		if pos.Version > g.first {
			prev, err := g.holder(ctx, pos.Aggregate, pos.Version-1)
			switch {
			case err != nil:
				return &gateRefusal{err}
			case prev == "":
				return &gateRefusal{&GapError{MessageID: msgID, Position: pos}}
			}
		}
		if err := handler(ctx); err != nil {
			return err
		}
		// After the effect, never before: see "Version order".
		return g.mark(ctx, msgID, pos)
	}
	res, err := g.in.Process(ctx, msgID, gated)
	var refused *gateRefusal
	if errors.Is(err, ErrHandler) && errors.As(err, &refused) {
		return 0, refused.err // the gate's verdict or its database error, not the handler's
	}
	if err == nil && res == Processed && already {
		return AlreadyApplied, nil
	}
	return res, err
}

// Skip marks the version at pos passed without an effect, held by msgID,
// so that the versions after it apply: for a message an operator discarded,
// or to start the gate on aggregates applied before it (mark each one's
// last applied version). A version marked already is left as it is.
func (g *Gate) Skip(ctx context.Context, pos Position, msgID string) error {
	if err := g.validPosition(pos); err != nil {
		return err
	}
	if err := validMessageID(msgID); err != nil {
		return err
	}
	_, err := g.coll.InsertOne(ctx, g.markDoc(msgID, pos, true))
	if err != nil && !mongo.IsDuplicateKeyError(err) {
		return fmt.Errorf("inbox: skip %s: %w", pos, err)
	}
	return nil
}

// gateRefusal carries the gate's own error through Inbox.Process, which
// wraps every error of its handler in ErrHandler.
type gateRefusal struct{ err error }

func (r *gateRefusal) Error() string { return r.err.Error() }
func (r *gateRefusal) Unwrap() error { return r.err }

func (g *Gate) validPosition(p Position) error {
	switch {
	case p.Aggregate == "":
		return fmt.Errorf("%w: empty aggregate", ErrInvalidPosition)
	case len(p.Aggregate) > maxAggregateLen:
		return fmt.Errorf("%w: aggregate of %d bytes, want at most %d", ErrInvalidPosition, len(p.Aggregate), maxAggregateLen)
	case !utf8.ValidString(p.Aggregate) || strings.ContainsRune(p.Aggregate, 0):
		return fmt.Errorf("%w: aggregate not valid UTF-8 without NUL", ErrInvalidPosition)
	case p.Version < g.first:
		return fmt.Errorf("%w: version %d below the first version %d", ErrInvalidPosition, p.Version, g.first)
	}
	return nil
}

// markKey is a mark's _id, "consumer/aggregate/version": unambiguous, as a
// consumer has no '/' and a version none either.
func (g *Gate) markKey(aggregate string, version int64) string {
	return g.in.consumer + "/" + aggregate + "/" + strconv.FormatInt(version, 10)
}

func (g *Gate) markDoc(msgID string, pos Position, skipped bool) bson.D {
	d := bson.D{
		{Key: "_id", Value: g.markKey(pos.Aggregate, pos.Version)},
		{Key: "consumer", Value: g.in.consumer},
		{Key: "aggregate", Value: pos.Aggregate},
		{Key: "version", Value: pos.Version},
		{Key: "message_id", Value: msgID},
		{Key: "applied_at", Value: time.Now()},
	}
	if skipped {
		d = append(d, bson.E{Key: "skipped", Value: true})
	}
	return d
}

// holder returns the id of the message holding the version of aggregate,
// "" if none does. Inside a transaction it reads the transaction's snapshot.
func (g *Gate) holder(ctx context.Context, aggregate string, version int64) (string, error) {
	var m struct {
		MessageID string `bson:"message_id"`
	}
	err := g.coll.FindOne(ctx, bson.D{{Key: "_id", Value: g.markKey(aggregate, version)}}).Decode(&m)
	switch {
	case errors.Is(err, mongo.ErrNoDocuments):
		return "", nil
	case err != nil:
		return "", fmt.Errorf("inbox: read the gate's mark of %s version %d: %w", aggregate, version, err)
	}
	return m.MessageID, nil
}

// mark records pos applied by msgID. Outside a transaction a duplicate key
// is a concurrent copy of the message that marked it first (fine: the
// handler's idempotence kept one effect) or a conflict. Inside one, its
// error is returned as it is: a write error has aborted the transaction.
func (g *Gate) mark(ctx context.Context, msgID string, pos Position) error {
	_, err := g.coll.InsertOne(ctx, g.markDoc(msgID, pos, false))
	if err == nil {
		return nil
	}
	if !mongo.IsDuplicateKeyError(err) || mongo.SessionFromContext(ctx) != nil {
		return &gateRefusal{fmt.Errorf("inbox: mark %s applied: %w", pos, err)}
	}
	held, herr := g.holder(ctx, pos.Aggregate, pos.Version)
	switch {
	case herr != nil:
		return &gateRefusal{herr}
	case held != msgID:
		return &gateRefusal{&ConflictError{MessageID: msgID, Position: pos, HeldBy: held}}
	}
	return nil
}

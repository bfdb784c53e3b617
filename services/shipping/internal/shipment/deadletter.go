package shipment

import (
	"errors"
	"time"
)

// A message that can never apply is dead-lettered. When its order and
// version are known it is kept as a Letter, with its message, and, unless
// its version applies anyway, holds its order (a Hold): a later version of
// that order waits as Parked until an operator replays or discards the
// dead letter, and other orders flow.

// Hold states.
const (
	StateHeld      = "held"
	StateReleasing = "releasing"
)

var (
	// ErrNoDeadLetter: no dead letter at that order and version, and no
	// release of that order to resume.
	ErrNoDeadLetter = errors.New("deadletter: no such dead letter")
	// ErrBodyNotKept: the dead letter's body was too large to keep, so it
	// cannot be replayed from its record (replay it from the dead-letter
	// queue, or discard it).
	ErrBodyNotKept = errors.New("deadletter: the message's body was too large to keep")
	// ErrParkedConflict: another message is parked at that order and
	// version.
	ErrParkedConflict = errors.New("deadletter: another message is parked at this version")
)

// KeptMessage is a message as kept for a later re-publish.
type KeptMessage struct {
	MessageID   string         `json:"message_id"`
	Type        string         `json:"type,omitempty"`
	ContentType string         `json:"content_type,omitempty"`
	RoutingKey  string         `json:"routing_key"` // as first published
	Headers     map[string]any `json:"-"`
	Body        []byte         `json:"-"`
	// BodyOmitted is the size of a body too large to keep, which Body then
	// lacks: the broker's dead-letter queue holds the whole message, and a
	// replay from the record is refused (ErrBodyNotKept). 0 when Body is
	// the whole body.
	BodyOmitted int `json:"body_omitted_bytes,omitempty"`
}

// Letter is a recorded dead letter.
type Letter struct {
	OrderID   string `json:"order_id"`
	Version   int64  `json:"version"`
	EventType string `json:"event_type"`
	Reason    string `json:"reason"`
	Error     string `json:"error"`
	Holds     bool   `json:"holds_order"` // its order's later versions are parked behind it
	// AwaitsPredecessor: dead-lettered because the version before it never
	// came (a gap). When that version applies after all, the gap is filled
	// and the dead letter is replayed with no operator.
	AwaitsPredecessor bool        `json:"awaits_predecessor,omitempty"`
	DeadLetteredAt    time.Time   `json:"dead_lettered_at"`
	Message           KeptMessage `json:"message"`
}

// Hold is an order whose later versions are parked behind a dead letter.
type Hold struct {
	OrderID string `json:"order_id"`
	Version int64  `json:"dead_version"`
	State   string `json:"state"`
	// Action is, while releasing, what the operator asked: "replay" or
	// "discard" (a resumed release repeats it).
	Action string    `json:"action,omitempty"`
	Token  string    `json:"-"`
	Since  time.Time `json:"since"`
	// Parked and OldestParkedAt count its parked messages, in a listing.
	Parked         int        `json:"parked"`
	OldestParkedAt *time.Time `json:"oldest_parked_at,omitempty"`
}

// Parked is a message parked behind its order's dead letter.
type Parked struct {
	OrderID  string      `json:"order_id"`
	Version  int64       `json:"version"`
	ParkedAt time.Time   `json:"parked_at"`
	Message  KeptMessage `json:"message"`
}

// Package shipment is the shipping service's domain: the order events it
// consumes, how they are validated, and the shipment they build.
//
// A shipment is the ordered chain of the order events applied to it: version
// 1 is order.created, each later event has the next version, without gaps.
// An event applies only on top of the version before it (pkg/inbox's version
// gate holds it back until then), so a cancel that overtook its create waits
// (it is deferred), and a second copy of an applied event is recognised by
// its version.
//
// Versions count every event of an order, including types this service does
// not handle (an order.paid added by the producer later): such an event is
// decoded as Ignored and recorded at its version as a no-op, so the next
// version finds its predecessor. A version an operator discarded (a dead
// letter) is recorded the same way, marked Discarded.
package shipment

import (
	"errors"
	"fmt"
	"time"
)

// Event types consumed.
const (
	TypeCreated   = "order.created"
	TypeCancelled = "order.cancelled"
	TypeAmended   = "order.amended"
)

// Shipment statuses.
const (
	StatusPending   = "pending"
	StatusCancelled = "cancelled"
)

var (
	// ErrNotFound: no shipment for that order (its create was not applied).
	ErrNotFound = errors.New("shipment not found")
	// ErrVersionConflict: another message was applied at the event's version.
	// The producer broke its versioning; the message needs a human.
	ErrVersionConflict = errors.New("shipment: another message holds this version")
)

// Item is one order line. Amounts are integer minor units of the currency.
type Item struct {
	SKU       string `json:"sku" bson:"sku"`
	Quantity  int64  `json:"quantity" bson:"quantity"`
	UnitPrice int64  `json:"unit_price" bson:"unit_price"`
}

// Created is the payload of order.created.
type Created struct {
	OrderID    string    `json:"order_id" bson:"order_id"`
	CustomerID string    `json:"customer_id" bson:"customer_id"`
	Currency   string    `json:"currency" bson:"currency"`
	Items      []Item    `json:"items" bson:"items"`
	Total      int64     `json:"total" bson:"total"`
	CreatedAt  time.Time `json:"created_at" bson:"created_at"`
}

// Cancelled is the payload of order.cancelled.
type Cancelled struct {
	OrderID     string    `json:"order_id" bson:"order_id"`
	CancelledAt time.Time `json:"cancelled_at" bson:"cancelled_at"`
}

// Amended is the payload of order.amended: the order's new note, which
// replaces the one before.
type Amended struct {
	OrderID   string    `json:"order_id" bson:"order_id"`
	Note      string    `json:"note" bson:"note"`
	AmendedAt time.Time `json:"amended_at" bson:"amended_at"`
}

// Outcome says what applying an event to its shipment did.
type Outcome int

const (
	// OutcomeApplied: the event was applied now.
	OutcomeApplied Outcome = iota + 1
	// OutcomeAlreadyApplied: the same message had been applied at that
	// version (a duplicate the inbox did not know).
	OutcomeAlreadyApplied
)

// Event is a validated order event. The message that carried it is named
// by its id beside it (Apply's messageID), not inside it.
type Event struct {
	Type    string
	OrderID string
	Version int64
	// AggregateType is the aggregate_type header (aggregatetype attribute),
	// or "".
	AggregateType string
	Created       *Created   // set for TypeCreated
	Cancelled     *Cancelled // set for TypeCancelled
	Amended       *Amended   // set for TypeAmended
	// Ignored marks an event type this service does not handle. It is still
	// recorded at its version, as a no-op, so that the order's later
	// versions, which count it, can apply.
	Ignored bool
}

// Applied is an event as recorded on its shipment.
type Applied struct {
	MessageID string    `json:"message_id"`
	EventType string    `json:"event_type"`
	Version   int64     `json:"version"`
	AppliedAt time.Time `json:"applied_at"`
	// Discarded: an operator discarded this dead-lettered version; it
	// counts in the chain, with no effect.
	Discarded bool `json:"discarded,omitempty"`
}

// Shipment is the state built from an order's applied events.
type Shipment struct {
	OrderID    string `json:"order_id"`
	Status     string `json:"status"`
	Version    int64  `json:"version"`
	CustomerID string `json:"customer_id,omitempty"`
	Currency   string `json:"currency,omitempty"`
	Items      []Item `json:"items,omitempty"`
	Total      int64  `json:"total"`
	// Note is the note of the last amendment applied, empty before one.
	Note   string    `json:"note,omitempty"`
	Events []Applied `json:"events"`
}

// Record is one applied event with its data, as a store keeps it.
type Record struct {
	Applied
	Created   *Created
	Cancelled *Cancelled
	Amended   *Amended
}

// Build folds an order's records, in version order, into its shipment.
// Records of event types this service ignores only advance the version. An
// order whose chain has no order.created has no shipment (ErrNotFound).
func Build(orderID string, records []Record) (Shipment, error) {
	if len(records) == 0 || records[0].EventType != TypeCreated || records[0].Discarded {
		return Shipment{}, ErrNotFound
	}
	s := Shipment{OrderID: orderID, Events: make([]Applied, 0, len(records))}
	for i, r := range records {
		if r.Version != int64(i+1) {
			return Shipment{}, fmt.Errorf("shipment %s: record %d has version %d", orderID, i, r.Version)
		}
		switch {
		case r.Discarded:
		case r.EventType == TypeCreated && r.Created != nil:
			s.Status = StatusPending
			s.CustomerID, s.Currency, s.Items, s.Total = r.Created.CustomerID, r.Created.Currency, r.Created.Items, r.Created.Total
		case r.EventType == TypeAmended && r.Amended != nil:
			s.Note = r.Amended.Note
		case r.EventType == TypeCancelled:
			s.Status = StatusCancelled
		}
		s.Version = r.Version
		s.Events = append(s.Events, r.Applied)
	}
	return s, nil
}

package order

import (
	"encoding/json"
	"time"
)

// CreatedPayload is the body of an order.created event (docs/events.md).
type CreatedPayload struct {
	OrderID    string    `json:"order_id"`
	CustomerID string    `json:"customer_id"`
	Currency   string    `json:"currency"`
	Items      []Item    `json:"items"`
	Total      int64     `json:"total"`
	CreatedAt  time.Time `json:"created_at"`
}

// CancelledPayload is the body of an order.cancelled event (docs/events.md).
type CancelledPayload struct {
	OrderID     string    `json:"order_id"`
	CancelledAt time.Time `json:"cancelled_at"`
}

// AmendedPayload is the body of an order.amended event (docs/events.md).
type AmendedPayload struct {
	OrderID   string    `json:"order_id"`
	Note      string    `json:"note"`
	AmendedAt time.Time `json:"amended_at"`
}

// AmendedEvent returns the order.amended payload of a.
func AmendedEvent(a Amendment) ([]byte, error) {
	return json.Marshal(AmendedPayload{OrderID: a.OrderID, Note: a.Note, AmendedAt: a.AmendedAt.UTC()})
}

// CreatedEvent returns the order.created payload of o.
func CreatedEvent(o Order) ([]byte, error) {
	return json.Marshal(CreatedPayload{
		OrderID: o.ID, CustomerID: o.CustomerID, Currency: o.Currency,
		Items: o.Items, Total: o.Total, CreatedAt: o.CreatedAt.UTC(),
	})
}

// CancelledEvent returns the order.cancelled payload of o.
func CancelledEvent(o Order) ([]byte, error) {
	return json.Marshal(CancelledPayload{OrderID: o.ID, CancelledAt: o.UpdatedAt.UTC()})
}

// Package order holds the orders domain: what an order is, what makes a request
// to create one valid, and the errors the rest of the service branches on.
package order

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Statuses an order can be in.
const (
	StatusCreated   = "created"
	StatusCancelled = "cancelled"
)

// Event types the orders service emits, and the aggregate type they belong to.
const (
	AggregateType  = "order"
	EventCreated   = "order.created"
	EventCancelled = "order.cancelled"
	EventAmended   = "order.amended"
)

// Limits on a create request. They keep a single order, its JSON and its total
// far from any overflow.
const (
	MaxItems       = 100
	MaxQuantity    = 1_000_000
	MaxUnitPrice   = 1_000_000_000_000 // 10^12 minor units
	MaxTextLength  = 128
	MaxIdemKeySize = 255
	// MaxNoteLength bounds an amendment's note, in characters.
	MaxNoteLength = 500
)

var (
	// ErrNotFound: no order with that id.
	ErrNotFound = errors.New("order not found")
	// ErrIdempotencyKeyReused: the Idempotency-Key was first used with a
	// different request body.
	ErrIdempotencyKeyReused = errors.New("idempotency key reused with a different request")
	// ErrCancelled: the order is cancelled, so it takes no amendment.
	ErrCancelled = errors.New("order is cancelled")
)

// ValidationError says which field of a request is wrong and why.
type ValidationError struct {
	Field   string
	Message string
}

func (e *ValidationError) Error() string { return e.Field + ": " + e.Message }

// Item is one line of an order. Amounts are integer minor units of the order's
// currency (cents for EUR).
type Item struct {
	SKU       string `json:"sku"`
	Quantity  int64  `json:"quantity"`
	UnitPrice int64  `json:"unit_price"`
}

// Order is an order as stored and returned by the API.
type Order struct {
	ID         string `json:"id"`
	CustomerID string `json:"customer_id"`
	Currency   string `json:"currency"`
	Items      []Item `json:"items"`
	Total      int64  `json:"total"`
	Status     string `json:"status"`
	Version    int64  `json:"version"`
	// Note is the note of the order's last amendment; empty before one.
	Note      string    `json:"note,omitempty"`
	CreatedAt time.Time `json:"created_at"`
	UpdatedAt time.Time `json:"updated_at"`
}

// CreateRequest is the body of POST /orders. Pointers tell a missing field from
// a zero one.
type CreateRequest struct {
	CustomerID *string       `json:"customer_id"`
	Currency   *string       `json:"currency"`
	Items      []RequestItem `json:"items"`
}

// RequestItem is one line of a CreateRequest.
type RequestItem struct {
	SKU       *string `json:"sku"`
	Quantity  *int64  `json:"quantity"`
	UnitPrice *int64  `json:"unit_price"`
}

// NewOrder is a validated create request, ready to be stored.
type NewOrder struct {
	CustomerID string
	Currency   string
	Items      []Item
	Total      int64
}

// Validate checks r and returns the order it describes, or a *ValidationError
// naming the first bad field.
func (r CreateRequest) Validate() (NewOrder, error) {
	var n NewOrder
	if r.CustomerID == nil {
		return n, &ValidationError{"customer_id", "is required"}
	}
	if err := checkText(*r.CustomerID); err != nil {
		return n, &ValidationError{"customer_id", err.Error()}
	}
	if r.Currency == nil {
		return n, &ValidationError{"currency", "is required"}
	}
	if !isCurrencyCode(*r.Currency) {
		return n, &ValidationError{"currency", "must be a three-letter upper-case ISO 4217 code"}
	}
	if r.Items == nil {
		return n, &ValidationError{"items", "is required"}
	}
	if len(r.Items) == 0 || len(r.Items) > MaxItems {
		return n, &ValidationError{"items", fmt.Sprintf("must hold 1 to %d items", MaxItems)}
	}
	n = NewOrder{CustomerID: *r.CustomerID, Currency: *r.Currency, Items: make([]Item, len(r.Items))}
	for i, it := range r.Items {
		field := func(name string) string { return fmt.Sprintf("items[%d].%s", i, name) }
		switch {
		case it.SKU == nil:
			return NewOrder{}, &ValidationError{field("sku"), "is required"}
		case it.Quantity == nil:
			return NewOrder{}, &ValidationError{field("quantity"), "is required"}
		case it.UnitPrice == nil:
			return NewOrder{}, &ValidationError{field("unit_price"), "is required"}
		}
		if err := checkText(*it.SKU); err != nil {
			return NewOrder{}, &ValidationError{field("sku"), err.Error()}
		}
		if q := *it.Quantity; q < 1 || q > MaxQuantity {
			return NewOrder{}, &ValidationError{field("quantity"), fmt.Sprintf("must be an integer from 1 to %d", MaxQuantity)}
		}
		if p := *it.UnitPrice; p < 1 || p > MaxUnitPrice {
			return NewOrder{}, &ValidationError{field("unit_price"), fmt.Sprintf("must be an integer from 1 to %d minor units", MaxUnitPrice)}
		}
		line := *it.Quantity * *it.UnitPrice // both bounded: at most 10^18, fits int64
		if n.Total > math.MaxInt64-line {
			return NewOrder{}, &ValidationError{"items", "order total overflows"}
		}
		n.Total += line
		n.Items[i] = Item{SKU: *it.SKU, Quantity: *it.Quantity, UnitPrice: *it.UnitPrice}
	}
	return n, nil
}

// Idempotency identifies a client's request across retries: its
// Idempotency-Key and a hash of the request it came with, so that the same
// key sent with another request is told apart (ErrIdempotencyKeyReused).
// The zero value means the client sent no key.
type Idempotency struct {
	Key         string
	RequestHash []byte
}

// CheckIdempotencyKey validates an Idempotency-Key header value.
func CheckIdempotencyKey(k string) error {
	if len(k) == 0 || len(k) > MaxIdemKeySize {
		return &ValidationError{"Idempotency-Key", fmt.Sprintf("must be 1 to %d characters", MaxIdemKeySize)}
	}
	for _, c := range []byte(k) {
		if c < 0x21 || c > 0x7e {
			return &ValidationError{"Idempotency-Key", "must be printable ASCII without spaces"}
		}
	}
	return nil
}

// AmendRequest is the body of POST /orders/{id}/amendments: a new note for
// the order (a delivery instruction, a correction), which replaces the last
// one and makes the order's next version.
type AmendRequest struct {
	Note *string `json:"note"`
}

// NewAmendment is a validated amendment request, ready to be stored.
type NewAmendment struct {
	Note string `json:"note"`
}

// Amendment is a committed amendment: the version of its order it made.
type Amendment struct {
	OrderID   string    `json:"order_id"`
	Version   int64     `json:"version"`
	Note      string    `json:"note"`
	AmendedAt time.Time `json:"amended_at"`
}

// Validate checks r and returns the amendment it describes, or a
// *ValidationError naming the bad field.
func (r AmendRequest) Validate() (NewAmendment, error) {
	if r.Note == nil {
		return NewAmendment{}, &ValidationError{"note", "is required"}
	}
	if err := checkTextLen(*r.Note, MaxNoteLength); err != nil {
		return NewAmendment{}, &ValidationError{"note", err.Error()}
	}
	return NewAmendment{Note: *r.Note}, nil
}

// RequireIdempotencyKey is CheckIdempotencyKey for a request that must carry
// a key: an amendment, which only a key makes safe to send again.
func RequireIdempotencyKey(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", &ValidationError{"Idempotency-Key", "is required: it makes a retry of the same request safe"}
	case 1:
		return values[0], CheckIdempotencyKey(values[0])
	default:
		return "", &ValidationError{"Idempotency-Key", "send one Idempotency-Key header"}
	}
}

func checkText(s string) error { return checkTextLen(s, MaxTextLength) }

func checkTextLen(s string, maxLen int) error {
	if strings.TrimSpace(s) == "" {
		return errors.New("must not be empty")
	}
	if !utf8.ValidString(s) {
		return errors.New("must be valid UTF-8")
	}
	if utf8.RuneCountInString(s) > maxLen {
		return fmt.Errorf("must be at most %d characters", maxLen)
	}
	for _, r := range s {
		if r == 0 {
			return errors.New("must not contain NUL bytes")
		}
		if unicode.IsControl(r) {
			return errors.New("must not contain control characters")
		}
	}
	return nil
}

func isCurrencyCode(s string) bool {
	if len(s) != 3 {
		return false
	}
	for _, c := range []byte(s) {
		if c < 'A' || c > 'Z' {
			return false
		}
	}
	return true
}

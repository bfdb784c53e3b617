package shipment

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"time"
	"unicode/utf8"
)

// Reason names why a message was dead-lettered. It travels in the
// dead-lettered message's x-dead-letter-reason header and labels the
// dead-letter metric.
type Reason string

// DefaultMaxDeferralAge is how long, by default, shipping keeps deferring a
// message after its first deferral before it dead-letters it (the
// processor's MaxDeferralAge, -max-deferral-age): the loss audit's grace
// must outlast it.
const DefaultMaxDeferralAge = 30 * time.Minute

// Dead-letter reasons.
const (
	// ReasonMissingMessageID: the message has no id the inbox can
	// deduplicate it by (pkg/inbox refuses it: inbox.ErrInvalidMessageID).
	ReasonMissingMessageID Reason = "missing_message_id"
	ReasonInvalidVersion   Reason = "invalid_version"
	ReasonMalformedPayload Reason = "malformed_payload"
	ReasonPayloadTooLarge  Reason = "payload_too_large"
	ReasonHandlerFailed    Reason = "handler_failed"
	ReasonGapNotFilled     Reason = "gap_not_filled"
	ReasonVersionConflict  Reason = "version_conflict"
	// ReasonInboxFailed: the inbox kept failing by itself (a transaction
	// that never stopped failing transiently, a database error such as
	// Unauthorized) through every deferral the service allows.
	ReasonInboxFailed Reason = "inbox_failed"
	// ReasonBeyondHorizon: the message was created longer ago than the
	// inbox keeps its records, and none is left (inbox.ErrBeyondHorizon):
	// it may have been applied and forgotten, so it is not applied again.
	ReasonBeyondHorizon Reason = "beyond_dedup_horizon"
	// ReasonInvalidCloudEvent: the message is in the CloudEvents envelope
	// (a cloudEvents_ or cloudEvents: header, or the structured content
	// type) but is no valid CloudEvents 1.0 event in the binary content
	// mode: a required attribute missing or of the wrong type, separators
	// mixed, a MessageId other than its id.
	ReasonInvalidCloudEvent Reason = "invalid_cloudevent"
)

// Reasons lists every Reason, e.g. to initialise metrics.
var Reasons = []Reason{
	ReasonMissingMessageID, ReasonInvalidVersion, ReasonMalformedPayload, ReasonPayloadTooLarge,
	ReasonHandlerFailed, ReasonGapNotFilled, ReasonVersionConflict, ReasonInboxFailed, ReasonBeyondHorizon,
	ReasonInvalidCloudEvent,
}

// InvalidError is a message that can never be applied: it goes to the
// dead-letter queue with its Reason.
type InvalidError struct {
	Reason Reason
	Err    error
}

func (e *InvalidError) Error() string { return fmt.Sprintf("%s: %v", e.Reason, e.Err) }
func (e *InvalidError) Unwrap() error { return e.Err }

func invalid(r Reason, format string, args ...any) error {
	return &InvalidError{Reason: r, Err: fmt.Errorf(format, args...)}
}

// Message is what the transport hands over: the AMQP properties and headers
// that the events contract (docs/events.md) defines, and the body.
type Message struct {
	// MessageID is the AMQP message-id property. It is the inbox's key,
	// which the processor takes (MessageID) and hands as it is to the inbox
	// (the one place that decides whether an id can be a key) and to the
	// store; Decode only refuses a CloudEvents message whose id attribute
	// disagrees with it.
	MessageID   string
	Type        string // AMQP type property
	ContentType string // AMQP content-type property
	RoutingKey  string
	Headers     map[string]any
	Body        []byte
}

// MaxBodyBytes bounds an event's body.
const MaxBodyBytes = 1 << 20

// MaxNoteBytes bounds an order.amended note: the orders API takes at most
// 500 characters, up to 2,000 bytes of UTF-8.
const MaxNoteBytes = 4096

// Decode validates m, in either envelope (see IsCloudEvent), into an Event.
// An event type this service does not
// handle decodes to an Event with Ignored set, placed by its aggregate_id
// header (or its payload's order_id) and its version, so that it can be
// recorded as a no-op: the order's later versions count it. A message that
// can never be applied is an *InvalidError (dead-letter it).
//
// The type is the AMQP type property, else the event_type header, else the
// routing key; a transport that republishes the message under another
// routing key (a delay queue) must pass the original one. In the
// CloudEvents envelope they are the attributes id, type, subject and
// aggregateversion, and an envelope that is not a valid CloudEvents event is
// an *InvalidError of ReasonInvalidCloudEvent.
func Decode(m Message) (Event, error) {
	if IsCloudEvent(m) {
		var err error
		if m, err = fromCloudEvent(m); err != nil {
			return Event{}, err
		}
	}
	typ := m.Type
	if typ == "" {
		typ, _ = m.Headers[headerEventType].(string)
	}
	if typ == "" {
		typ = m.RoutingKey
	}
	if len(m.Body) > MaxBodyBytes {
		return Event{}, invalid(ReasonPayloadTooLarge, "body of %d bytes exceeds %d", len(m.Body), MaxBodyBytes)
	}

	version, err := headerVersion(m.Headers)
	if err != nil {
		return Event{}, invalid(ReasonInvalidVersion, "%v", err)
	}
	if typ != TypeCreated && typ != TypeCancelled && typ != TypeAmended {
		return decodeIgnored(m, typ, version)
	}
	if typ == TypeCreated && version != 1 {
		return Event{}, invalid(ReasonInvalidVersion, "%s must be version 1, got %d", typ, version)
	}
	if typ != TypeCreated && version < 2 {
		return Event{}, invalid(ReasonInvalidVersion, "%s must follow order.created (version >= 2), got %d", typ, version)
	}

	aggType, _ := m.Headers[headerAggregateType].(string)
	ev := Event{Type: typ, Version: version, AggregateType: aggType}
	switch typ {
	case TypeCreated:
		var c Created
		if err := decodeJSON(m.Body, &c); err != nil {
			return Event{}, err
		}
		if err := validateCreated(c); err != nil {
			return Event{}, err
		}
		ev.OrderID, ev.Created = c.OrderID, &c
	case TypeCancelled:
		var c Cancelled
		if err := decodeJSON(m.Body, &c); err != nil {
			return Event{}, err
		}
		if err := text(c.OrderID, 200); err != nil {
			return Event{}, invalid(ReasonMalformedPayload, "order_id: %v", err)
		}
		ev.OrderID, ev.Cancelled = c.OrderID, &c
	case TypeAmended:
		var a Amended
		if err := decodeJSON(m.Body, &a); err != nil {
			return Event{}, err
		}
		if err := text(a.OrderID, 200); err != nil {
			return Event{}, invalid(ReasonMalformedPayload, "order_id: %v", err)
		}
		if err := text(a.Note, MaxNoteBytes); err != nil {
			return Event{}, invalid(ReasonMalformedPayload, "note: %v", err)
		}
		ev.OrderID, ev.Amended = a.OrderID, &a
	}
	if agg, ok := m.Headers[headerAggregateID].(string); ok && agg != "" && agg != ev.OrderID {
		return Event{}, invalid(ReasonMalformedPayload, "payload order_id %q differs from header aggregate_id %q", ev.OrderID, agg)
	}
	return ev, nil
}

// decodeIgnored places an event of a type this service does not handle in
// its order's chain: its payload is not validated, only its order id.
func decodeIgnored(m Message, typ string, version int64) (Event, error) {
	if err := text(typ, 200); err != nil {
		return Event{}, invalid(ReasonMalformedPayload, "event type: %v", err)
	}
	orderID, _ := m.Headers[headerAggregateID].(string)
	if orderID == "" {
		var p struct {
			OrderID string `json:"order_id"`
		}
		if utf8.Valid(m.Body) {
			_ = json.Unmarshal(m.Body, &p)
		}
		orderID = p.OrderID
	}
	if err := text(orderID, 200); err != nil {
		return Event{}, invalid(ReasonMalformedPayload, "%s: no order id in the aggregate_id header nor in the payload's order_id: %v", typ, err)
	}
	aggType, _ := m.Headers[headerAggregateType].(string)
	return Event{Type: typ, OrderID: orderID, Version: version, AggregateType: aggType, Ignored: true}, nil
}

// Locate returns the order and version a message claims in its headers
// (aggregate_id, aggregate_version; in the CloudEvents envelope, subject and
// aggregateversion), whatever its payload: where a message that cannot be
// applied would sit in its order's chain. A CloudEvents envelope that is not
// valid claims nothing.
func Locate(m Message) (orderID string, version int64, ok bool) {
	if IsCloudEvent(m) {
		var err error
		if m, err = fromCloudEvent(m); err != nil {
			return "", 0, false
		}
	}
	orderID, _ = m.Headers[headerAggregateID].(string)
	version, err := headerVersion(m.Headers)
	if err != nil || text(orderID, 200) != nil {
		return "", 0, false
	}
	return orderID, version, true
}

// headerVersion reads aggregate_version, an integer header.
func headerVersion(h map[string]any) (int64, error) {
	raw, ok := h[headerAggregateVersion]
	if !ok {
		return 0, errors.New("header aggregate_version is missing")
	}
	var v int64
	switch x := raw.(type) {
	case int64:
		v = x
	case int32:
		v = int64(x)
	case int16:
		v = int64(x)
	case int8:
		v = int64(x)
	case int:
		v = int64(x)
	case uint8:
		v = int64(x)
	case uint16:
		v = int64(x)
	case uint32:
		v = int64(x)
	case float64:
		if x != math.Trunc(x) || x < 1 || x > 1<<53 {
			return 0, fmt.Errorf("header aggregate_version %v is not a positive integer", x)
		}
		v = int64(x)
	default:
		return 0, fmt.Errorf("header aggregate_version has type %T, want an integer", raw)
	}
	if v < 1 {
		return 0, fmt.Errorf("header aggregate_version %d: want >= 1", v)
	}
	return v, nil
}

// decodeJSON decodes exactly one JSON object. Unknown fields are allowed, so
// the producer can add some without breaking this consumer.
func decodeJSON(b []byte, v any) error {
	if !utf8.Valid(b) {
		return invalid(ReasonMalformedPayload, "body is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(v); err != nil {
		return invalid(ReasonMalformedPayload, "body is not the expected JSON object: %v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return invalid(ReasonMalformedPayload, "body has data after the JSON object")
	}
	return nil
}

func validateCreated(c Created) error {
	if err := text(c.OrderID, 200); err != nil {
		return invalid(ReasonMalformedPayload, "order_id: %v", err)
	}
	if err := text(c.CustomerID, 200); err != nil {
		return invalid(ReasonMalformedPayload, "customer_id: %v", err)
	}
	if err := text(c.Currency, 16); err != nil {
		return invalid(ReasonMalformedPayload, "currency: %v", err)
	}
	for i, it := range c.Items {
		if it.Quantity < 0 || it.UnitPrice < 0 {
			return invalid(ReasonMalformedPayload, "items[%d]: negative quantity or unit_price", i)
		}
		if err := text(it.SKU, 200); err != nil {
			return invalid(ReasonMalformedPayload, "items[%d].sku: %v", i, err)
		}
	}
	if c.Total < 0 {
		return invalid(ReasonMalformedPayload, "negative total")
	}
	return nil
}

func text(s string, maxLen int) error {
	switch {
	case s == "":
		return errors.New("empty")
	case len(s) > maxLen:
		return fmt.Errorf("%d bytes, want at most %d", len(s), maxLen)
	case !utf8.ValidString(s):
		return errors.New("not valid UTF-8")
	case strings.ContainsRune(s, 0):
		return errors.New("contains NUL")
	}
	return nil
}

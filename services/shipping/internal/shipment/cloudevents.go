package shipment

import (
	"errors"
	"fmt"
	"math"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// A message reaches shipping in one of two envelopes (docs/events.md): the
// outbox envelope (MessageId, the type property, the headers aggregate_id,
// aggregate_version...), or a CloudEvents 1.0 event in the binary content
// mode of the CloudEvents AMQP protocol binding, as outboxamqp publishes it
// with Config.CloudEvents: each attribute in a header named "cloudEvents_"
// or "cloudEvents:" and the attribute's name. A message with any header so
// named is read as a CloudEvents event, and then only its attributes count.

// The CloudEvents attributes shipping reads.
const (
	ceSpecVersion      = "specversion"
	ceID               = "id"
	ceSource           = "source"
	ceType             = "type"
	ceSubject          = "subject"
	ceTime             = "time"
	ceDataContentType  = "datacontenttype"
	ceAggregateType    = "aggregatetype"
	ceAggregateVersion = "aggregateversion"
	ceTraceparent      = "traceparent"
	ceTracestate       = "tracestate"
)

// The outbox envelope's headers.
const (
	headerAggregateType    = "aggregate_type"
	headerAggregateID      = "aggregate_id"
	headerEventType        = "event_type"
	headerAggregateVersion = "aggregate_version"
	// HeaderCreatedAt is the outbox row's creation time (RFC 3339, to the
	// microsecond) the relay sends with each event of the outbox envelope.
	HeaderCreatedAt = "outbox_created_at"
)

// OrderKey returns the order a message's headers name: the outbox
// envelope's aggregate_id, or the CloudEvents subject; "" when they name
// none (the payload, not read here, may still).
func OrderKey(headers map[string]any) string {
	if id, ok := headers[headerAggregateID].(string); ok && id != "" {
		return id
	}
	for k, v := range headers {
		if attr, _, ok := cloudEventsName(k); ok && attr == ceSubject {
			if id, ok := v.(string); ok {
				return id
			}
		}
	}
	return ""
}

// cloudEventsName returns the attribute a header name stands for, and the
// separator it uses ('_' or ':'); ok is false for any other header. The
// prefix is matched as the binding writes it: "cloudEvents".
func cloudEventsName(key string) (attr string, sep byte, ok bool) {
	rest, found := strings.CutPrefix(key, "cloudEvents")
	if !found || rest == "" || (rest[0] != '_' && rest[0] != ':') {
		return "", 0, false
	}
	return rest[1:], rest[0], true
}

// IsCloudEvent says whether m is a CloudEvents event, in either content
// mode: a header in the attributes' space, or a content type of the
// CloudEvents media type (the structured content mode).
func IsCloudEvent(m Message) bool {
	if structured(m.ContentType) {
		return true
	}
	for k := range m.Headers {
		if _, _, ok := cloudEventsName(k); ok {
			return true
		}
	}
	return false
}

// sameMediaType says whether two content types name the same media type
// (parameters such as charset aside, case ignored).
func sameMediaType(a, b string) bool {
	media := func(s string) string {
		s, _, _ = strings.Cut(s, ";")
		return strings.TrimSpace(s)
	}
	return strings.EqualFold(media(a), media(b))
}

func structured(contentType string) bool {
	return len(contentType) >= len("application/cloudevents") &&
		strings.EqualFold(contentType[:len("application/cloudevents")], "application/cloudevents")
}

// CloudEventAttr returns the value of the CloudEvents attribute name in h,
// whichever separator its header uses.
func CloudEventAttr(h map[string]any, name string) (any, bool) {
	if v, ok := h["cloudEvents_"+name]; ok {
		return v, true
	}
	v, ok := h["cloudEvents:"+name]
	return v, ok
}

// CreatedAt returns when the event was created, as the envelope says: the
// CloudEvents time attribute (the canonical string or an AMQP timestamp),
// else the outbox envelope's outbox_created_at header.
func CreatedAt(h map[string]any) (time.Time, bool) {
	v, ok := CloudEventAttr(h, ceTime)
	if !ok {
		if v, ok = h[HeaderCreatedAt]; !ok {
			return time.Time{}, false
		}
	}
	switch t := v.(type) {
	case string:
		created, err := time.Parse(time.RFC3339Nano, t)
		return created, err == nil
	case time.Time:
		return t, true
	}
	return time.Time{}, false
}

// fromCloudEvent reads m, a CloudEvents event, into the outbox envelope's
// terms: the message id is the id attribute, the type the type attribute,
// the headers aggregate_id, aggregate_version, aggregate_type and
// outbox_created_at come from the attributes subject, aggregateversion,
// aggregatetype and time (same-named headers of m are dropped), and the
// rest of m's headers stay. A message that is no valid CloudEvents event in
// the binary content mode is an *InvalidError of ReasonInvalidCloudEvent; a
// missing or invalid aggregateversion is one of ReasonInvalidVersion, as in
// the outbox envelope.
func fromCloudEvent(m Message) (Message, error) {
	if structured(m.ContentType) {
		return m, invalid(ReasonInvalidCloudEvent, "content type %q: the structured content mode is not accepted, only the binary one", m.ContentType)
	}
	attrs := map[string]any{}
	var sep byte
	for k, v := range m.Headers {
		name, s, ok := cloudEventsName(k)
		if !ok {
			continue
		}
		if sep != 0 && s != sep {
			return m, invalid(ReasonInvalidCloudEvent, "the attributes' headers mix the separators '_' and ':'")
		}
		sep = s
		if !attributeName(name) {
			return m, invalid(ReasonInvalidCloudEvent, "header %q: %q is not a CloudEvents attribute name (lower-case letters and digits)", k, name)
		}
		attrs[name] = v
	}
	str := func(name string, required bool) (string, error) {
		v, ok := attrs[name]
		if !ok {
			if required {
				return "", invalid(ReasonInvalidCloudEvent, "the required attribute %s is missing", name)
			}
			return "", nil
		}
		s, ok := v.(string)
		if !ok {
			return "", invalid(ReasonInvalidCloudEvent, "attribute %s has type %T, want a string", name, v)
		}
		if err := text(s, 1024); err != nil {
			return "", invalid(ReasonInvalidCloudEvent, "attribute %s: %v", name, err)
		}
		return s, nil
	}
	spec, err := str(ceSpecVersion, true)
	if err != nil {
		return m, err
	}
	if spec != "1.0" {
		return m, invalid(ReasonInvalidCloudEvent, "specversion %q: only 1.0 is accepted", spec)
	}
	// The binary content mode carries datacontenttype as the content-type
	// property; several SDKs send it as a header as well. One that agrees
	// with the property (or stands alone) is accepted; one that contradicts
	// it leaves the body's format unknown.
	if v, ok := attrs[ceDataContentType]; ok {
		dct, isText := v.(string)
		if !isText || (m.ContentType != "" && !sameMediaType(dct, m.ContentType)) {
			return m, invalid(ReasonInvalidCloudEvent, "attribute datacontenttype %v in a header contradicts the content-type property %q", v, m.ContentType)
		}
		if m.ContentType == "" {
			m.ContentType = dct
		}
	}
	id, err := str(ceID, true)
	if err != nil {
		return m, err
	}
	source, err := str(ceSource, true)
	if err != nil {
		return m, err
	}
	if _, err := url.Parse(source); err != nil || strings.ContainsAny(source, " \t\r\n") {
		return m, invalid(ReasonInvalidCloudEvent, "source %q is not a URI-reference", source)
	}
	typ, err := str(ceType, true)
	if err != nil {
		return m, err
	}
	subject, err := str(ceSubject, false)
	if err != nil {
		return m, err
	}
	aggType, err := str(ceAggregateType, false)
	if err != nil {
		return m, err
	}
	var created time.Time
	if v, ok := attrs[ceTime]; ok {
		switch t := v.(type) {
		case string:
			if created, err = time.Parse(time.RFC3339Nano, t); err != nil {
				return m, invalid(ReasonInvalidCloudEvent, "time %q is not an RFC 3339 timestamp", t)
			}
		case time.Time:
			created = t
		default:
			return m, invalid(ReasonInvalidCloudEvent, "attribute time has type %T, want a timestamp or its string", v)
		}
	}
	for _, name := range []string{ceTraceparent, ceTracestate} {
		if _, err := str(name, false); err != nil {
			return m, err
		}
	}
	if m.MessageID != "" && m.MessageID != id {
		return m, invalid(ReasonInvalidCloudEvent, "MessageId %q differs from the id attribute %q: which one deduplicates?", m.MessageID, id)
	}
	version, err := ceVersion(attrs)
	if err != nil {
		return m, invalid(ReasonInvalidVersion, "%v", err)
	}

	h := make(map[string]any, len(m.Headers)+4)
	for k, v := range m.Headers {
		h[k] = v
	}
	for _, k := range []string{headerAggregateType, headerAggregateID, headerEventType, headerAggregateVersion, HeaderCreatedAt} {
		delete(h, k)
	}
	h[headerAggregateVersion] = version
	if subject != "" {
		h[headerAggregateID] = subject
	}
	if aggType != "" {
		h[headerAggregateType] = aggType
	}
	if !created.IsZero() {
		h[HeaderCreatedAt] = created.UTC().Format(time.RFC3339Nano)
	}
	m.MessageID, m.Type, m.Headers = id, typ, h
	return m, nil
}

// MessageID is m's id, the inbox's key: the AMQP message-id property, or,
// in a CloudEvents message that has none, its id attribute (Decode refuses
// one where the two disagree). It is the one place the id is decided: the
// inbox, the store and a kept dead letter or parked message all take it
// from here. It does not judge whether the id can be a key: the inbox does.
func MessageID(m Message) string {
	if m.MessageID != "" || !IsCloudEvent(m) {
		return m.MessageID
	}
	id, _ := CloudEventAttr(m.Headers, ceID)
	s, _ := id.(string)
	return s
}

// ceVersion reads the aggregateversion attribute: an Integer, as an AMQP
// integer of any width or its canonical string.
func ceVersion(attrs map[string]any) (int64, error) {
	v, ok := attrs[ceAggregateVersion]
	if !ok {
		return 0, errors.New("the attribute aggregateversion is missing")
	}
	if s, ok := v.(string); ok {
		n, err := strconv.ParseInt(s, 10, 32)
		if err != nil {
			return 0, fmt.Errorf("attribute aggregateversion %q is not a CloudEvents Integer", s)
		}
		v = n
	}
	n, err := headerVersion(map[string]any{headerAggregateVersion: v})
	if err != nil {
		return 0, fmt.Errorf("attribute aggregateversion: %w", err)
	}
	if n > math.MaxInt32 {
		return 0, fmt.Errorf("attribute aggregateversion %d exceeds the CloudEvents Integer's range", n)
	}
	return n, nil
}

// attributeName says whether s is a CloudEvents attribute name: lower-case
// ASCII letters and digits, at least one.
func attributeName(s string) bool {
	if s == "" {
		return false
	}
	for i := range len(s) {
		if c := s[i]; (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

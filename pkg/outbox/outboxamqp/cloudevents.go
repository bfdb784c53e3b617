package outboxamqp

import (
	"errors"
	"fmt"
	"math"
	"net/url"
	"strings"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// CloudEvents configures the CloudEvents envelope (Config.CloudEvents): each
// event is published as a CloudEvents 1.0 event in the binary content mode
// of the CloudEvents AMQP protocol binding. See the package documentation
// for the mapping.
type CloudEvents struct {
	// Source is every event's source attribute: a non-empty URI-reference
	// naming the context the events come from, e.g. "/orders" or
	// "urn:example:orders". CloudEvents asks that source and id together be
	// unique for each distinct event; the id is the message id (the outbox
	// row's id and creation time, outbox.MessageID), unique within one outbox
	// table, so give each outbox table a source of its own.
	// Required, at most 1024 bytes.
	Source string
}

// The CloudEvents attributes this package sets, as AMQP header names
// (CloudEventsPrefix and the attribute's name).
const (
	// CloudEventsPrefix is the prefix of a CloudEvents attribute's AMQP
	// application property (here: header) name. The AMQP binding allows
	// "cloudEvents_" and "cloudEvents:", one of them throughout a message,
	// and prefers "_": JMS 2.0 clients and message selectors cannot use a
	// ':' in a property name.
	CloudEventsPrefix = "cloudEvents_"
	// CloudEventsSpecVersion is the specversion attribute's value.
	CloudEventsSpecVersion = "1.0"

	HeaderCESpecVersion = CloudEventsPrefix + "specversion"
	HeaderCEID          = CloudEventsPrefix + "id"
	HeaderCESource      = CloudEventsPrefix + "source"
	HeaderCEType        = CloudEventsPrefix + "type"
	HeaderCESubject     = CloudEventsPrefix + "subject"
	HeaderCETime        = CloudEventsPrefix + "time"
	// HeaderCEAggregateType and HeaderCEAggregateVersion are extension
	// attributes: the event's aggregate type (String) and its version within
	// its aggregate (Integer).
	HeaderCEAggregateType    = CloudEventsPrefix + "aggregatetype"
	HeaderCEAggregateVersion = CloudEventsPrefix + "aggregateversion"
	// HeaderCETraceparent and HeaderCETracestate are the attributes of the
	// CloudEvents distributed tracing extension: the event's creation
	// context, from the envelope's traceparent and tracestate headers.
	HeaderCETraceparent = CloudEventsPrefix + "traceparent"
	HeaderCETracestate  = CloudEventsPrefix + "tracestate"
)

// maxSourceBytes bounds CloudEvents.Source.
const maxSourceBytes = 1024

// Validate checks ce as New does.
func (ce *CloudEvents) Validate() error {
	switch {
	case ce.Source == "":
		return errors.New("outboxamqp: CloudEvents.Source is required")
	case len(ce.Source) > maxSourceBytes:
		return fmt.Errorf("outboxamqp: CloudEvents.Source has %d bytes, more than %d", len(ce.Source), maxSourceBytes)
	case !utf8.ValidString(ce.Source) || strings.ContainsAny(ce.Source, "\x00 \t\r\n"):
		return fmt.Errorf("outboxamqp: CloudEvents.Source %q is not a URI-reference", ce.Source)
	}
	if _, err := url.Parse(ce.Source); err != nil {
		return fmt.Errorf("outboxamqp: CloudEvents.Source is not a URI-reference: %w", err)
	}
	return nil
}

// isCloudEventsName says whether a header name is in the CloudEvents
// attributes' space: either separator the AMQP binding allows, in any case.
func isCloudEventsName(name string) bool {
	const n = len(CloudEventsPrefix)
	return len(name) >= n && strings.EqualFold(name[:n-1], CloudEventsPrefix[:n-1]) && (name[n-1] == '_' || name[n-1] == ':')
}

// CloudEventsPublishing returns the AMQP message the Publisher sends for e
// with Config.CloudEvents set to ce: a CloudEvents 1.0 event in the binary
// content mode (see the package documentation). It fails when e cannot be
// such an event: a version beyond the CloudEvents Integer's range (2^31-1),
// or a header of e whose name starts with "cloudEvents_" or "cloudEvents:"
// (those are the attributes this function sets).
func CloudEventsPublishing(e outbox.Envelope, ce CloudEvents) (amqp.Publishing, error) {
	if err := ce.Validate(); err != nil {
		return amqp.Publishing{}, err
	}
	return ce.publishing(e)
}

// publishing is CloudEventsPublishing with ce validated.
func (ce *CloudEvents) publishing(e outbox.Envelope) (amqp.Publishing, error) {
	if e.AggregateVersion < 1 || e.AggregateVersion > math.MaxInt32 {
		return amqp.Publishing{}, fmt.Errorf("outboxamqp: aggregate version %d does not fit the CloudEvents Integer of the aggregateversion attribute (1 to %d)",
			e.AggregateVersion, math.MaxInt32)
	}
	h := make(amqp.Table, len(e.Headers)+10)
	for k, v := range e.Headers {
		if isCloudEventsName(k) {
			return amqp.Publishing{}, fmt.Errorf("outboxamqp: header %q: names starting with cloudEvents_ or cloudEvents: are the CloudEvents attributes the publisher sets", k)
		}
		switch k {
		case "aggregate_type", "aggregate_id", "event_type", "aggregate_version", HeaderCreatedAt:
			// The outbox envelope's own headers: their values travel as
			// attributes here.
			continue
		}
		// The trace context stays in the transport's own headers too: the
		// distributed tracing extension does not replace them.
		h[k] = v
	}
	id := e.MessageID()
	h[HeaderCESpecVersion] = CloudEventsSpecVersion
	h[HeaderCEID] = id
	h[HeaderCESource] = ce.Source
	h[HeaderCEType] = e.EventType
	h[HeaderCESubject] = e.AggregateID
	if !e.CreatedAt.IsZero() {
		// The canonical string form: an AMQP 0-9-1 timestamp has whole
		// seconds only.
		h[HeaderCETime] = e.CreatedAt.UTC().Format(time.RFC3339Nano)
	}
	h[HeaderCEAggregateType] = e.AggregateType
	h[HeaderCEAggregateVersion] = e.AggregateVersion // an AMQP long
	if tp := e.Headers["traceparent"]; tp != "" {
		h[HeaderCETraceparent] = tp
		if ts := e.Headers["tracestate"]; ts != "" {
			h[HeaderCETracestate] = ts
		}
	}
	return amqp.Publishing{
		Headers:      h,
		ContentType:  "application/json", // the datacontenttype attribute
		DeliveryMode: amqp.Persistent,
		MessageId:    id,
		Timestamp:    e.CreatedAt,
		Type:         e.EventType,
		Body:         e.Payload,
	}, nil
}

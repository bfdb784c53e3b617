// Package outboxnats publishes outbox events to NATS JetStream. Its
// Publisher implements outbox.Publisher with github.com/nats-io/nats.go, so
// either relay (outbox.Relay, outboxwal.Relay) drives it; it lives in its
// own package so that copying pkg/outbox does not bring in a broker client.
// It passes the conformance kit pkg/outbox/publishertest, as outboxamqp
// does.
//
// # What goes on the wire
//
// Each envelope becomes one message on the subject Config.SubjectPrefix +
// "." + its event type (or Config.Subject's), which a stream must capture:
//
//	Nats-Msg-Id        outbox.MessageID: the row's id and creation time, the stream's and the consumer's deduplication key
//	aggregate_type     the aggregate type
//	aggregate_id       the aggregate id
//	event_type         the event type
//	aggregate_version  the aggregate version, in decimal
//	outbox_created_at  the row's creation, RFC 3339 UTC to the microsecond
//	data               the JSON payload
//
// plus the row's own headers (e.g. traceparent); the five above win over a
// free header of the same name. NATS carries a header as it is only if its
// name is printable ASCII without a colon and its value has no line break
// and no surrounding white space (the client would change it), and names
// starting with "Nats-" steer the server: a message with such a header fails
// by itself, as a counted attempt, until the relay dead-letters it; so does
// one whose subject is not valid (an event type with white space, an empty
// token or a wildcard), or larger than the server's max_payload (1 MiB by
// default, the size of outbox.DefaultMaxPayloadBytes before headers).
//
// # When a message counts as published
//
// PublishBatch sends every message of the batch with the asynchronous
// JetStream publish, then waits for each acknowledgement: nil only for a
// positive one, the stream having stored the message (on its replicas'
// majority, for a replicated stream; to disk as the server's sync_interval
// says). An acknowledgement marked duplicate is positive: the stream
// recognised the Nats-Msg-Id within its Duplicates window (2 minutes by
// default) and holds the message from an earlier attempt, so a relay that
// publishes a message again after a lost acknowledgement does not store it
// twice, and does not take it for a failure.
//
// Every other outcome is that message's error: no stream takes the subject
// (the server's "no responders", wrapping outbox.ErrUnroutable, not retried
// by the client), the stream refused it (an error acknowledgement: a limit,
// a size), or no verdict before the connection ended or ctx's deadline
// (outcome unknown: the stream may hold it, and takes the next attempt as a
// duplicate). A message that never left the process (no connection, no room
// for another pending acknowledgement before the deadline, see
// Config.MaxInFlight) wraps outbox.ErrNotSent, and so do the rest of its
// batch.
//
// The messages of a batch are written in order on the one connection, and
// a stream stores what one connection sends in that order: one aggregate's
// events of a batch are stored in version order.
//
// # Connection management
//
// NewPublisher does not connect. WaitReady dials when there is no live
// connection, with jittered exponential backoff between failures
// (Config.ReconnectMin to ReconnectMax), checks that the server runs
// JetStream, and returns once connected. The client's own reconnection is
// off, and so is its buffer of messages published while reconnecting: a
// connection that ends fails the acknowledgements still awaited on it at
// once, and the next WaitReady dials again. Config.URL may list a cluster's
// servers, separated by commas.
//
// Ready answers at once, without dialling, whether the publisher holds a
// live connection (for a readiness probe). Close it when the relay has
// stopped.
//
// # Switching a service to NATS
//
// Create a stream that captures the subjects, with file storage and, on a
// cluster, three replicas; a Duplicates window longer than the relay's
// PublishTimeout and backoff before a retry, so that a retried message is
// recognised:
//
//	nats stream add ORDERS --subjects 'orders.events.>' --storage file --replicas 3 --dupe-window 10m
//
// then give the relay this package's Publisher in place of outboxamqp's.
// Consumers deduplicate by the Nats-Msg-Id header as they do by the AMQP
// message id, and apply each aggregate's events by aggregate_version.
package outboxnats

// Package outboxamqp publishes outbox events to RabbitMQ. Its Publisher
// implements outbox.Publisher with github.com/rabbitmq/amqp091-go; it lives in
// its own package so that copying pkg/outbox does not bring in a broker client.
//
// # What goes on the wire
//
// Each envelope becomes one message on Config.Exchange (a durable exchange,
// topic by default, declared on every connection), with the event type as
// routing key unless Config.RoutingKey says otherwise (with Config.Queue: on
// the default exchange, to that one queue, for a replay):
//
//	MessageId     outbox.MessageID: the row's id and creation time, the consumer's deduplication key
//	Type          the event type
//	ContentType   application/json
//	DeliveryMode  2 (persistent)
//	Timestamp     when the event was written to the outbox (whole seconds)
//	Headers       aggregate_type, aggregate_id, event_type (strings),
//	              aggregate_version (int64), outbox_created_at (the
//	              Timestamp to the microsecond, RFC 3339 UTC), plus the row's
//	              headers (e.g. traceparent, tracestate); the five above win
//	              over a free header of the same name
//
// Messages are published with mandatory set, in confirm mode.
//
// # CloudEvents
//
// With Config.CloudEvents set, each envelope is published as a CloudEvents
// 1.0 event in the binary content mode of the CloudEvents AMQP protocol
// binding (CloudEventsPublishing): the payload is the body, the data content
// type is the content-type property, and every other attribute is a header
// (AMQP 0-9-1's application properties) named with the prefix
// "cloudEvents_":
//
//	cloudEvents_specversion       "1.0"
//	cloudEvents_id                the message id, outbox.MessageID (also MessageId)
//	cloudEvents_source            CloudEvents.Source
//	cloudEvents_type              the event type
//	cloudEvents_subject           the aggregate id
//	cloudEvents_time              the row's creation, RFC 3339 UTC to the microsecond
//	cloudEvents_aggregatetype     extension: the aggregate type (String)
//	cloudEvents_aggregateversion  extension: the aggregate version (Integer, an AMQP long)
//	cloudEvents_traceparent       distributed tracing extension, from the
//	cloudEvents_tracestate        row's traceparent and tracestate headers
//
// The binding allows the separators '_' and ':' and prefers '_', which JMS
// 2.0 clients and selectors can read; the binding's 1.0.2 release knew only
// ':', so a consumer should accept both (one of them throughout a message).
// Values take the binding's canonical string form where the AMQP 0-9-1 type
// would lose something: time is a string, since a 0-9-1 timestamp holds
// whole seconds. The row's own headers (traceparent, tracestate, baggage...)
// are sent too, as they are: the tracing extension carries the event's
// creation context, and does not replace the transport's trace headers,
// which a consumer that republishes may replace with its own. The outbox
// envelope's headers (aggregate_type, aggregate_id, event_type,
// aggregate_version, outbox_created_at) are not sent: their values are the
// attributes. MessageId, Type, Timestamp and DeliveryMode are set as in the
// outbox envelope: the broker's tools show them, and returns are matched by
// MessageId.
//
// A message that cannot be such an event fails by itself, as a counted
// attempt, until the relay dead-letters it: a version above 2^31-1 (the
// CloudEvents Integer's range), or a header of the row named with either
// prefix. The headers table is larger than outbox.MaxHeaderBytes measures by
// the attributes' names, the source, and the trace context repeated, a few
// hundred bytes beside a tracestate; RabbitMQ's default frame_max (128 KiB)
// leaves that room, and a message the broker refuses for its size is
// dead-lettered by the relay alone, as any refused message is.
//
// The official CloudEvents Go SDK is not used: its AMQP binding
// (protocol/amqp) is built on github.com/Azure/go-amqp, an AMQP 1.0 client,
// a second client beside amqp091-go, while RabbitMQ's AMQP 0-9-1 needs only
// the mapping above.
//
// # When a message counts as published
//
// PublishBatch sends the whole batch before waiting (many messages in flight),
// and ties each message to its own delivery tag with
// PublishWithDeferredConfirmWithContext. A message succeeds only with a
// positive confirm and no basic.return. RabbitMQ sends the return of an
// unroutable mandatory message before its ack; the client puts returns into a
// buffer of Config.MaxInFlight slots (one buffer per channel) before it
// processes the following ack,
// and PublishBatch has that buffer drained after the acks and before it reads
// any verdict, so a return is never missed or attributed after its ack.
// Returns are matched to messages by MessageId. The goroutine that takes them
// never logs, blocks or waits for a contended lock: the client drops a
// notification that is not taken within 5s, and a dropped return would let an
// unroutable message count as published (a logger that blocks cannot cause
// that). If the returns cannot be checked before the deadline, an acked
// message is reported as an outcome-unknown failure, never as published.
//
// Every other outcome is an error for that message: a nack, a return (wrapping
// outbox.ErrUnroutable), a confirm still missing at the deadline, or a
// connection or channel that closed with confirms outstanding (their outcome is
// unknown: the broker may hold the message, so the relay retries it and
// consumers may see it twice). When the broker itself closed the channel or the
// connection because of a message it was sent (406 PRECONDITION_FAILED, such as
// RabbitMQ's unacceptable_type_in_header for a CC header that is not a list;
// 501 FRAME_ERROR for a frame over frame_max; 502 SYNTAX_ERROR), it does not say
// which message: the errors of the messages without a verdict wrap
// outbox.ErrBatchRefused, and the relay sends each alone next time, without
// counting the attempt, so the refused one fails alone and the others go out.
// A message that was never handed to the connection (not connected, broker
// blocking until the deadline, channel already closed) wraps outbox.ErrNotSent,
// and the relay retries it without counting an attempt.
//
// # Connection management
//
// NewPublisher does not connect. WaitReady dials when there is no live connection, with
// jittered exponential backoff between failures (Config.ReconnectMin to
// ReconnectMax), and returns once connected; a broker that is down at start
// only delays the relay, which claims nothing meanwhile. A close of the
// connection ends the session: outstanding confirms fail, and the next
// WaitReady dials again.
//
// Each batch publishes on a confirm-mode channel of its own (taken from the
// connection's idle channels, or opened), its messages one after the other
// in the batch's order, so the events of one aggregate in a batch (a run,
// see outbox.Publisher) reach their queues in version order. A fault on one batch's channel
// fails that batch only: after a nack (on RabbitMQ 3.10 a channel that got a
// quorum queue's nack during a leader election went on nacking), confirms
// still missing at the deadline, or the broker closing it, the channel is
// closed and never used again, while other batches' channels and the
// connection go on; if the broker does not even answer the channel's close
// within a second, the connection is closed. What belongs to the connection
// (a broken socket, a connection-level error, a write stuck on a broker that
// stopped reading) still fails every batch in flight on it.
//
// A batch reaches the socket in a few writes, not one per message: amqp091-go
// writes each publish on its own, and the publisher's connection gathers the
// frames of a batch while it is being framed and writes them when it has
// been, or every 64 KiB, or before the batch waits for a blocked broker.
// That saves a system call per message on each side of the connection; a
// batch of one is written at once, as before. It changes no outcome: a
// message counts as published only on its confirm, and a write of gathered
// frames that fails closes the connection, so the batch's confirms end as
// not acked, outcome unknown.
//
// On a RabbitMQ cluster, Config.URL lists the nodes, separated by commas. A
// connection attempt tries them in turn (each within DialTimeout), starting
// after the node of the last connection, and backs off only when every node
// failed; so a connection lost with its node moves to another one. The
// contract does not change: a message counts as published only on its
// confirm, which a quorum queue sends once a majority of its replicas hold the
// message; a confirm lost with the node leaves the outcome unknown and the
// relay publishes the message again.
//
// RabbitMQ blocks publishers (connection.blocked) when it runs low on memory
// or disk. WaitReady then waits for connection.unblocked, and a batch being
// sent pauses between messages. A batch whose confirms time out while the
// broker blocks the connection keeps the connection (its channel takes no
// other batch and is closed once the broker unblocks): a new connection would
// not be known blocked until it published, so each batch claimed on it would
// time out too and cost its events an attempt for as long as the alarm lasts.
// If a deadline passes while a write is stuck on a broker that stopped
// reading, the connection is closed (with a deadline of its own) so
// PublishBatch returns on time and nothing more is written after the relay
// gave up on the batch.
//
// The connection's frame_max bounds a message's content header frame, which
// carries its headers: WaitReady warns when the negotiated frame_max is smaller
// than a message whose headers fill outbox.MaxHeaderBytes needs.
//
// Every notification channel registered with the client (returns, blocked,
// channel and connection close) is drained by a goroutine of the session for
// as long as the client may write to it: the client drops notifications that
// nobody reads, and a dropped return would be a lost message.
//
// Ready answers at once, without dialling, whether the publisher holds a live
// connection that the broker is not blocking, and otherwise why
// not (ErrNotConnected with the lost connection's cause and the last failed
// attempt, the broker's blocking reason, or ErrClosed): a readiness probe of
// the relay's process reports the broker with it.
//
// One Publisher holds one connection and one channel per batch in flight; it is
// safe for concurrent use by the relay's workers, whose batches are sent and
// confirmed concurrently, each on its channel. Close it when the relay has
// stopped.
package outboxamqp

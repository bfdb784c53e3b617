package shipment

import "fmt"

// Delivery is a message as the broker handed it to the consumer: what a
// handler (the processor) decides on.
type Delivery struct {
	MessageID   string
	Type        string
	ContentType string
	Exchange    string
	RoutingKey  string
	Headers     map[string]any
	Body        []byte
	Redelivered bool
}

// Action is what to do with a delivery.
type Action int

const (
	// Ack: done (processed, duplicate, or deliberately ignored).
	Ack Action = iota + 1
	// Defer: republish a copy to the delay queue (confirmed), then ack; the
	// copy comes back after the delay. The delivery limit is not touched.
	Defer
	// DeadLetter: republish a copy to the dead-letter exchange with the
	// reason (confirmed), then ack.
	DeadLetter
	// Retry: keep the delivery unacked and handle it again after a backoff
	// (a dependency such as MongoDB is down). Nothing is acked, nothing is
	// requeued, so the delivery limit is not burnt.
	Retry
)

func (a Action) String() string {
	switch a {
	case Ack:
		return "ack"
	case Defer:
		return "defer"
	case DeadLetter:
		return "dead_letter"
	case Retry:
		return "retry"
	default:
		return fmt.Sprintf("Action(%d)", int(a))
	}
}

// Verdict is a handler's decision about one delivery.
type Verdict struct {
	Action Action
	// Reason labels Defer ("gap", "in_progress", "retry") and DeadLetter
	// (a reason code, sent as HeaderReason).
	Reason string
	// Detail is the error text sent as HeaderError with a DeadLetter.
	Detail string
	// Headers are set on the republished copy (Defer, DeadLetter).
	Headers map[string]any
}

// Headers the consumer writes on the copies it republishes.
const (
	// HeaderReason is the dead-letter reason code, e.g. "malformed_payload".
	HeaderReason = "x-dead-letter-reason"
	// HeaderError is the human-readable error that sent the message to the
	// dead-letter queue.
	HeaderError = "x-error"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey keep where the
	// message was first published (a deferred message comes back through the
	// default exchange).
	HeaderOriginalExchange   = "x-original-exchange"
	HeaderOriginalRoutingKey = "x-original-routing-key"
	// HeaderDeadLetteredBy names the service that dead-lettered it.
	HeaderDeadLetteredBy = "x-dead-lettered-by"
)

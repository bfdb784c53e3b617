package mongodb

import (
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// MessageTime reads an event's creation time from its message id
// (outbox.MessageID), for the inbox's dedup horizon and its tallies. It lives
// beside the stores rather than in the domain, which imports the standard
// library only.
func MessageTime(msgID string) (time.Time, bool) {
	_, created, err := outbox.ParseMessageID(msgID)
	return created, err == nil && !created.IsZero()
}

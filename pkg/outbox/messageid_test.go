package outbox_test

import (
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// A message id reads back as the outbox id and the creation time it was made
// of, to the microsecond; anything else, an id without its creation time
// included, is refused.
func TestParseMessageIDReadsBackMessageID(t *testing.T) {
	t.Parallel()
	created := time.Date(2025, 12, 2, 8, 0, 0, 123456789, time.UTC)
	s := outbox.MessageID(42, created)
	if s != "42-1764662400123456" {
		t.Fatalf("MessageID = %q", s)
	}
	id, at, err := outbox.ParseMessageID(s)
	if err != nil || id != 42 || !at.Equal(created.Truncate(time.Microsecond)) {
		t.Fatalf("ParseMessageID(%q) = %d, %v, %v", s, id, at, err)
	}
	for _, bad := range []string{"", "42", "42-", "x-1", "042-1", "0-1", "-1-1", "42-1x", "42-01"} {
		if _, _, err := outbox.ParseMessageID(bad); err == nil {
			t.Errorf("ParseMessageID(%q) accepted", bad)
		}
	}
}

package outboxamqp_test

import (
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// The creation time travels to the microsecond in a header: the Timestamp
// property keeps whole seconds only, so a consumer measuring commit to
// effect in milliseconds reads the header.
func TestPublishingCarriesTheCreationTimeToTheMicrosecond(t *testing.T) {
	t.Parallel()
	created := time.Date(2026, 11, 29, 23, 0, 0, 123456000, time.FixedZone("CET", 3600))
	m := outboxamqp.Publishing(outbox.Envelope{ID: 7, AggregateType: "order", AggregateID: "o-1", AggregateVersion: 1,
		EventType: "order.created", Payload: []byte(`{}`), Headers: map[string]string{outboxamqp.HeaderCreatedAt: "forged"},
		CreatedAt: created})
	got, _ := m.Headers[outboxamqp.HeaderCreatedAt].(string)
	if got != "2026-11-29T22:00:00.123456Z" {
		t.Errorf("%s = %q, want the creation time in UTC to the microsecond", outboxamqp.HeaderCreatedAt, got)
	}
	if parsed, err := time.Parse(time.RFC3339Nano, got); err != nil || !parsed.Equal(created) {
		t.Errorf("%q parses as %v, %v; want %v", got, parsed, err, created)
	}
	if _, ok := outboxamqp.Publishing(outbox.Envelope{ID: 8}).Headers[outboxamqp.HeaderCreatedAt]; ok {
		t.Error("an envelope without a creation time got a creation header")
	}
}

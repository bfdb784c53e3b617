package shipment

import "testing"

func TestOrderKeyNamesTheOrderOfEitherEnvelope(t *testing.T) {
	for _, c := range []struct {
		name    string
		headers map[string]any
		want    string
	}{
		{"outbox envelope", map[string]any{"aggregate_id": "o-1", "cloudEvents:subject": "o-2"}, "o-1"},
		{"CloudEvents, AMQP binding", map[string]any{"cloudEvents:subject": "o-2"}, "o-2"},
		{"CloudEvents, underscore", map[string]any{"cloudEvents_subject": "o-3"}, "o-3"},
		{"empty aggregate_id falls through", map[string]any{"aggregate_id": "", "cloudEvents_subject": "o-4"}, "o-4"},
		{"not a string", map[string]any{"aggregate_id": int64(7)}, ""},
		{"another attribute", map[string]any{"cloudEvents:source": "orders"}, ""},
		{"none", nil, ""},
	} {
		if got := OrderKey(c.headers); got != c.want {
			t.Errorf("%s: OrderKey(%v) = %q, want %q", c.name, c.headers, got, c.want)
		}
	}
}

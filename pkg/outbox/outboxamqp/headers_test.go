package outboxamqp_test

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// largestAccepted returns the largest n for which Enqueue's validation accepts
// with(n), found by bisection between lo (accepted) and hi (refused).
func largestAccepted(t *testing.T, lo, hi int, with func(n int) outbox.Message) int {
	t.Helper()
	valid := func(n int) bool {
		_, err := (&outbox.Writer{}).Queue(&pgx.Batch{}, with(n))
		return err == nil
	}
	if !valid(lo) || valid(hi) {
		t.Fatalf("bisection bounds: valid(0)=%v valid(%d)=%v", valid(lo), hi, valid(hi))
	}
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if valid(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// Every edge of what Enqueue accepts reaches the real broker and a consumer,
// headers intact, confirmed at the first attempt: names of the short
// strings' full length, an empty name, lowercase cc and bcc (RabbitMQ only
// reads CC and BCC), names RabbitMQ uses itself (x-death...) as strings,
// multi-byte text, empty values, thousands of small headers, and headers
// exactly as large as MaxHeaderBytes allows, which a consumer's client must
// take back too.
func TestEveryAcceptedEdgeCaseReachesTheBroker(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	b := newBroker(t, true)
	ctx := context.Background()

	long := func(n int) string { return strings.Repeat("x", n) }
	many := map[string]string{}
	for i := range 5000 {
		many[fmt.Sprintf("h%03x", i)] = "v"
	}
	withValue := func(n int) outbox.Message {
		m := msg("at-the-limit", "order.created")
		m.Headers = map[string]string{"baggage": long(n)}
		return m
	}
	atLimit := withValue(largestAccepted(t, 0, outbox.MaxHeaderBytes, withValue))
	withID := func(n int) outbox.Message {
		m := msg("x", "order.created")
		m.AggregateID = long(n)
		return m
	}
	longID := withID(largestAccepted(t, 1, outbox.MaxHeaderBytes, withID))
	withNames := func(n int) outbox.Message {
		m := msg("many-at-the-limit", "order.created")
		m.Headers = map[string]string{}
		for i := range n {
			m.Headers[fmt.Sprintf("%04x", i)] = ""
		}
		return m
	}
	manyAtLimit := withNames(largestAccepted(t, 0, 10_000, withNames))

	cases := map[string]outbox.Message{
		"255-byte header name":         with(msg("name-255", "order.created"), map[string]string{long(255): "v"}),
		"empty header name":            with(msg("empty-name", "order.created"), map[string]string{"": "v"}),
		"lowercase and mixed cc, bcc":  with(msg("cc", "order.created"), map[string]string{"cc": "a", "bcc": "b", "Cc": "c", "CCC": "d"}),
		"names RabbitMQ uses, strings": with(msg("x-names", "order.created"), map[string]string{"x-death": "a", "x-delay": "1", "x-match": "all", "x-first-death-queue": "q"}),
		"reserved names replaced":      with(msg("reserved", "order.created"), map[string]string{"aggregate_id": "spoofed", "event_type": "spoofed"}),
		"multi-byte text":              with(msg("utf8", "order.created"), map[string]string{"clé-日本": "välue-日本語"}),
		"empty values":                 with(msg("empty-values", "order.created"), map[string]string{"a": "", "b": ""}),
		"5,000 small headers":          with(msg("many", "order.created"), many),
		"headers at MaxHeaderBytes":    atLimit,
		"aggregate id at the limit":    longID,
		"4-byte names at the limit":    manyAtLimit,
		"255-byte types":               {AggregateType: long(255), AggregateID: "types-255", EventType: "order." + long(249), Payload: []byte(`{}`)},
	}
	byID := map[int64]string{}
	want := map[string]outbox.Message{}
	for name, m := range cases {
		e := enqueue(t, pool, m)
		byID[e[0].ID] = name
		want[name] = m
	}

	startRelay(t, pool, newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil)), relayConfig(t))
	ds := b.WaitDeliveries("every edge case", 60*time.Second, func(ds []amqp.Delivery) bool { return len(receivedIDs(ds)) == len(cases) })
	for _, d := range ds {
		id, _, _ := outbox.ParseMessageID(d.MessageId)
		name, ok := byID[id]
		if !ok {
			t.Fatalf("delivery %q is no message of the test", d.MessageId)
		}
		m := want[name]
		wantHeaders := amqp.Table{}
		for k, v := range m.Headers {
			wantHeaders[k] = v
		}
		wantHeaders["aggregate_type"] = m.AggregateType
		wantHeaders["aggregate_id"] = m.AggregateID
		wantHeaders["event_type"] = m.EventType
		wantHeaders["aggregate_version"] = int64(1)
		created, _ := d.Headers[outboxamqp.HeaderCreatedAt].(string)
		if _, err := time.Parse(time.RFC3339Nano, created); err != nil {
			t.Errorf("%s: header %s = %q: %v", name, outboxamqp.HeaderCreatedAt, created, err)
		}
		wantHeaders[outboxamqp.HeaderCreatedAt] = created
		if !maps.EqualFunc(d.Headers, wantHeaders, func(a, b any) bool { return a == b }) {
			t.Errorf("%s: delivered headers differ from the message's (%d entries, want %d)", name, len(d.Headers), len(wantHeaders))
		}
	}
	var retried int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published WHERE attempts <> 1").Scan(&retried); err != nil {
		t.Fatal(err)
	}
	if retried != 0 {
		t.Fatalf("%d edge cases needed more than one attempt", retried)
	}
	waitFor(t, "every edge case marked published", 10*time.Second, outboxEmpty(pool))
}

func with(m outbox.Message, headers map[string]string) outbox.Message {
	m.Headers = headers
	return m
}

package outboxamqp_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// After a failover to an asynchronous standby, the new primary's id sequence
// can be behind ids the old primary handed out to events that were published
// and then lost with it: the next event gets such an id again. A message id
// that were the id alone would make the consumer's inbox drop the new event
// as a duplicate of the lost one. The test plays the failover on one server:
// an event is published, its row removed as if the standby never received
// it, the sequence moved back; the event written next takes the same id and
// must go out under another message id.
func TestMessageIDIsNotReusedWhenTheSequenceGoesBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newTestPool(t)
	b := newBroker(t, true)
	pub := newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil))
	relay := startRelay(t, pool, pub, relayConfig(t))

	lost := enqueue(t, pool, msg("o-lost", "order.created"))
	relay.Wake()
	first := b.WaitDeliveries("the event the failover loses", 10*time.Second, allReceived(lost))
	waitFor(t, "the lost event marked", 10*time.Second, func() (bool, error) {
		return len(publishedIDs(t, pool)) == 1, nil
	})

	// The failover: the standby never had the row, and its sequence is
	// where the row's id had not been handed out yet.
	if _, err := pool.Exec(ctx, `DELETE FROM outbox_published WHERE id = $1`, lost[0].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT setval(pg_get_serial_sequence('outbox', 'id'), $1, false)`, lost[0].ID); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Millisecond) // a later transaction, on any clock
	next := enqueue(t, pool, msg("o-new", "order.created"))
	if next[0].ID != lost[0].ID {
		t.Fatalf("the new event has id %d, want the lost event's id %d reused", next[0].ID, lost[0].ID)
	}
	relay.Wake()
	all := b.WaitDeliveries("the event written after the failover", 10*time.Second, func(ds []amqp.Delivery) bool {
		for _, d := range ds {
			if d.Headers["aggregate_id"] == "o-new" {
				return true
			}
		}
		return false
	})
	ids := map[string][]string{}
	for _, d := range all {
		agg, _ := d.Headers["aggregate_id"].(string)
		ids[d.MessageId] = append(ids[d.MessageId], agg)
	}
	lostID := first[0].MessageId
	if aggs := ids[lostID]; len(aggs) != 1 {
		t.Fatalf("message id %q was sent for the events of %v: a consumer's inbox drops the new one as a duplicate", lostID, aggs)
	}
	for id := range ids {
		gotID, _, err := outbox.ParseMessageID(id)
		if err != nil || gotID != lost[0].ID {
			t.Errorf("message id %q: outbox id %d, %v; want %d", id, gotID, err, lost[0].ID)
		}
	}
}

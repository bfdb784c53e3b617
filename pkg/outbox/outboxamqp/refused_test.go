package outboxamqp_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// A row the broker refuses although Enqueue let it through (here a CC header
// written by hand: RabbitMQ closes the channel with 406 on it, without saying
// which message of the batch it refused) must not take its batch-mates down
// with it at every attempt: the messages of that batch without a verdict go
// out alone next time, at no attempt's cost, the refused one fails alone
// until it is dead-lettered with the broker's reason, and every other row is
// published at its first attempt.
func TestRelayIsolatesARowTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	b := newBroker(t, true)

	var msgs []outbox.Message
	for i := range 30 {
		msgs = append(msgs, msg(fmt.Sprintf("o-%d", i), "order.created"))
	}
	events := enqueue(t, pool, msgs...)
	poison := events[10].ID
	if _, err := pool.Exec(ctx, `UPDATE outbox SET headers = headers || '{"CC": "audit"}' WHERE id = $1`, poison); err != nil {
		t.Fatal(err)
	}

	var (
		mu       sync.Mutex
		alone    []int64 // batches of one: their ids
		isolated int
	)
	const maxAttempts = 3
	cfg := relayConfig(t)
	cfg.Workers = 1
	cfg.BatchSize = 100
	cfg.MaxAttempts = maxAttempts
	cfg.RetryBackoffMin, cfg.RetryBackoffMax = 10*time.Millisecond, 20*time.Millisecond
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		mu.Lock()
		defer mu.Unlock()
		isolated += len(r.Isolated)
		if r.Claimed == 1 {
			alone = append(alone, slices.Concat(r.Published, r.Failed, r.DeadLettered, r.Isolated, r.NotSent)...)
		}
	})
	startRelay(t, pool, newPublisher(t, testAMQPURL(), b.Exchange, testLogger(t, nil)), cfg)

	waitFor(t, "every other row published and the refused one dead-lettered", 60*time.Second, func() (bool, error) {
		var left, dead int
		err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE dead_lettered_at IS NULL), count(*) FILTER (WHERE dead_lettered_at IS NOT NULL) FROM outbox`).Scan(&left, &dead)
		return left == 0 && dead == 1, err
	})
	dls, err := outboxadmin.New(pool).DeadLetters(ctx, 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 || dls[0].ID != poison || dls[0].Attempts != maxAttempts || !strings.Contains(dls[0].LastError, "unacceptable_type_in_header") {
		t.Fatalf("dead letters %+v, want row %d after %d attempts with the broker's reason", dls, poison, maxAttempts)
	}
	var retried int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published WHERE attempts <> 1").Scan(&retried); err != nil {
		t.Fatal(err)
	}
	if retried != 0 {
		t.Fatalf("%d rows besides the refused one burned an attempt", retried)
	}
	mu.Lock()
	defer mu.Unlock()
	if isolated == 0 {
		t.Fatal("no row of the refused batch was isolated")
	}
	if n := len(slices.DeleteFunc(slices.Clone(alone), func(id int64) bool { return id != poison })); n < maxAttempts-1 {
		t.Fatalf("the refused row went out alone %d times, want every attempt after its first batch (%d)", n, maxAttempts-1)
	}
	checkMarkedWereReceived(t, pool, b)
}

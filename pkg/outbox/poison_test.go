package outbox_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// crashingPublisher sends like memPublisher, but computes each message's
// routing key first with a user function, as outboxamqp does. When that
// function panics, the relay process would die: the publisher then ends the
// worker goroutine (runtime.Goexit), so the relay instance stops with its batch
// half sent and no outcome written, as after a crash, while the test goes on.
type crashingPublisher struct {
	memPublisher
	routingKey func(outbox.Envelope) string
}

func (p *crashingPublisher) PublishBatch(ctx context.Context, msgs []outbox.Envelope) []error {
	for _, m := range msgs {
		if crashed := p.route(m); crashed {
			runtime.Goexit()
		}
		p.memPublisher.PublishBatch(ctx, []outbox.Envelope{m})
	}
	return make([]error, len(msgs))
}

func (p *crashingPublisher) route(m outbox.Envelope) (crashed bool) {
	defer func() {
		if recover() != nil {
			crashed = true
		}
	}()
	_ = p.routingKey(m)
	return false
}

// A message whose publishing crashes the relay (a panic in a user routing key,
// an out-of-memory on a huge payload) must not crash every relay after it
// forever, nor take its batch-mates down with it each time: once it was in
// flight at two crashes in a row, the row is retried alone, and dead-lettered
// with a reason once it used its attempts. Retried by an operator, it still
// goes out alone.
func TestRelayDeadLettersARowThatCrashesItsRelays(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	var before, after []outbox.Message
	for i := range 10 {
		before = append(before, msg(fmt.Sprintf("good-%d", i), "order.created"))
		after = append(after, msg(fmt.Sprintf("good-%d", 10+i), "order.created"))
	}
	enqueue(t, pool, before...)
	poison := enqueue(t, pool, msg("poison", "order.created"), msg("poison", "order.cancelled"))
	enqueue(t, pool, after...)

	pub := &crashingPublisher{routingKey: func(e outbox.Envelope) string {
		if e.AggregateID == "poison" {
			panic("routing key: nil map")
		}
		return e.EventType
	}}
	const maxAttempts = 3
	cfg := fastConfig(t)
	cfg.Workers = 1 // so the crash of its worker is the end of the relay
	cfg.VacuumEvery = -1
	cfg.Lease = 400 * time.Millisecond
	cfg.PublishTimeout = 200 * time.Millisecond
	cfg.PollInterval = 20 * time.Millisecond
	cfg.MaxAttempts = maxAttempts
	var mu sync.Mutex
	var deadAtClaim []int64
	cfg.Observer = outboxtest.OnBatch(cfg.Observer, func(r outboxtest.BatchResult) {
		mu.Lock()
		defer mu.Unlock()
		deadAtClaim = append(deadAtClaim, r.DeadLetteredAtClaim...)
	})
	deadLettered := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(deadAtClaim) > 0
	}

	// Run relays one after the other, each replacing the one that crashed, as
	// a process supervisor would, until the poison row is dead-lettered.
	var crashes int
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var running chan error
	for !deadLettered() {
		if crashes > 2*maxAttempts {
			t.Fatalf("relays crashed %d times and the row is still handed out", crashes)
		}
		relay, err := outbox.NewRelay(pool, pub, cfg)
		if err != nil {
			t.Fatal(err)
		}
		running = make(chan error, 1)
		go func() { running <- relay.Run(runCtx) }()
		// Wait for this relay to crash, or for the dead letter.
		for !deadLettered() {
			select {
			case <-running:
				crashes++
				running = nil
			case <-time.After(10 * time.Millisecond):
				continue
			}
			break
		}
	}
	t.Logf("relays crashed %d times before the row was dead-lettered", crashes)
	if crashes > maxAttempts {
		t.Fatalf("relays crashed %d times, want at most MaxAttempts (%d)", crashes, maxAttempts)
	}

	// The row was dead-lettered at claim, with a reason, and never handed out
	// again; its aggregate's next event waits behind it.
	mu.Lock()
	gotDead := append([]int64(nil), deadAtClaim...)
	mu.Unlock()
	if len(gotDead) != 1 || gotDead[0] != poison[0].ID {
		t.Fatalf("dead-lettered at claim %v, want [%d]", gotDead, poison[0].ID)
	}
	outboxtest.WantCrashDeadLetter(t, pool, poison[0].ID, maxAttempts)

	// Every other aggregate flows, through the relay still running: it does
	// not crash any more.
	waitFor(t, "other aggregates published", 20*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE aggregate_id <> 'poison'").Scan(&n)
		return n == 0, err
	})
	late := enqueue(t, pool, msg("late", "order.created"))
	waitFor(t, "a later event published", 20*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_published WHERE id = $1", late[0].ID).Scan(&n)
		return n == 1, err
	})
	select {
	case <-running:
		t.Fatal("the relay crashed after the row was dead-lettered")
	default:
	}

	deliveries := map[int64]int{}
	for _, e := range pub.Snapshot() {
		if e.AggregateID == "poison" {
			t.Fatalf("a poison event was published: %+v", e)
		}
		deliveries[e.ID]++
		// Sent before the poison in the batches of the first two crashes,
		// then alone, since in flight at both.
		if deliveries[e.ID] > 3 {
			t.Fatalf("event %d delivered %d times", e.ID, deliveries[e.ID])
		}
	}
	if len(deliveries) != len(before)+len(after)+1 {
		t.Fatalf("%d events published, want %d", len(deliveries), len(before)+len(after)+1)
	}
	var pending int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE id = $1 AND blocked", poison[1].ID).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 1 {
		t.Fatal("the poison aggregate's next event is not waiting behind the dead letter")
	}

	stop()
	if running != nil {
		if err := <-running; err != nil {
			t.Fatalf("Run: %v", err)
		}
	}

	// Retried by an operator (the cause may not be fixed), the row goes out
	// alone although other rows are due with it, and its aggregate follows.
	others := enqueue(t, pool, msg("other-1", "order.created"), msg("other-2", "order.created"))
	if err := outboxadmin.New(pool).Retry(ctx, poison[0].ID); err != nil {
		t.Fatal(err)
	}
	batches := &batchPublisher{}
	cfg.Observer = nil
	startRelay(t, pool, batches, cfg)
	waitFor(t, "the retried row and the others published", 20*time.Second, outboxEmpty(pool))
	for _, b := range batches.batchIDs() {
		if slices.Contains(b, poison[0].ID) && len(b) != 1 {
			t.Fatalf("the retried row went out in a batch of %d (%v), want alone; others were %d and %d", len(b), b, others[0].ID, others[1].ID)
		}
	}
}

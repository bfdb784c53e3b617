package outboxwal_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// Under synchronous replication a commit is flushed locally, then waits for
// the standby, and only then becomes visible and is acknowledged to the
// client. The stream delivers it at the flush. An event published in that
// window describes a change a failover can still undo: the standby never got
// it, the client never got its answer. Here the standby is stopped, so the
// writer's commit waits; the relay (whose own bookkeeping commits locally)
// has decoded the event but must not publish it until the standby is back.
func TestNothingIsPublishedBeforeTheSynchronousStandbyHasIt(t *testing.T) {
	ctx := context.Background()
	primary := migratedServer(t)
	standby := primary.NewStandby(t, "s1")
	primary.Exec(t, `ALTER SYSTEM SET synchronous_standby_names = 's1'`)
	primary.Exec(t, `SELECT pg_reload_conf()`)
	writers := serverPool(t, primary.URL("postgres"))
	waitFor(t, "the standby synchronous", 30*time.Second, func() (bool, error) {
		var n int
		err := writers.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE application_name = 's1' AND sync_state = 'sync'`).Scan(&n)
		return n == 1, err
	})

	br := newBroker(t, "#")
	relayPool := serverPool(t, primary.URL("postgres")+"&synchronous_commit=local")
	relay, _ := startWAL(t, relayPool, newPublisherForTest(t, br), walFromServer(t))
	waitActive(t, relay)

	standby.Stop(t, "fast")
	back := false
	defer func() {
		if !back { // let the waiting commit return, or the writers' pool never closes
			standby.Start(t)
		}
	}()
	committed := make(chan []outbox.Enqueued, 1)
	go func() {
		var out []outbox.Enqueued
		err := pgx.BeginFunc(ctx, writers, func(tx pgx.Tx) error {
			var err error
			out, err = new(outbox.Writer).Enqueue(ctx, tx, outboxtest.Msg("waits-for-the-standby", "order.created"))
			return err
		})
		if err != nil {
			t.Errorf("enqueue: %v", err)
		}
		committed <- out
	}()
	waitFor(t, "the relay decoding the event", 30*time.Second, func() (bool, error) { return relay.Stats().InMemory == 1, nil })
	time.Sleep(time.Second) // the relay publishes a visible event within milliseconds
	select {
	case <-committed:
		t.Fatal("the commit returned while the synchronous standby was down")
	default:
	}
	if n := len(br.Deliveries()); n != 0 {
		t.Fatalf("%d messages published while their transaction waited for the synchronous standby", n)
	}

	standby.Start(t)
	back = true
	var ev []outbox.Enqueued
	select {
	case ev = <-committed:
	case <-time.After(60 * time.Second):
		t.Fatal("the commit did not return after the standby came back")
	}
	br.waitIDs("the event, once its commit is acknowledged", ev)
}

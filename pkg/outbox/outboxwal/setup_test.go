package outboxwal_test

import (
	"context"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest/amqptest"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest/waltest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

var (
	testAMQPURL = outboxtest.AMQPURL
	unavailable = outboxtest.Unavailable
	msg         = outboxtest.Msg
	enqueue     = outboxtest.Enqueue
	waitFor     = outboxtest.WaitFor
	outboxEmpty = outboxtest.OutboxEmpty
)

// The WAL relay's helpers shared with the publishers' tests (see waltest).
const (
	slotPrefix = waltest.SlotPrefix
	longWait   = waltest.LongWait
)

var (
	requireLogical = waltest.RequireLogical
	walConfig      = waltest.Config
	startWAL       = waltest.Start
	waitActive     = waltest.WaitActive
)

func TestMain(m *testing.M) {
	if os.Getenv(crashingRelayEnv) != "" {
		os.Exit(runCrashingRelay())
	}
	dropStaleSlots()
	outboxtest.SweepStalePGServers()
	goleak.VerifyTestMain(m)
}

func dropStaleSlots() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, outboxtest.DatabaseURL())
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT slot_name FROM pg_replication_slots WHERE NOT active AND slot_name LIKE $1`, slotPrefix+"%")
	if err != nil {
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	for _, n := range names {
		ts, err := strconv.ParseInt(strings.SplitN(strings.TrimPrefix(n, slotPrefix), "_", 2)[0], 10, 64)
		if err != nil || time.Since(time.Unix(ts, 0)) < 30*time.Minute {
			continue
		}
		_, _ = conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, n)
		_, _ = conn.Exec(ctx, `DROP PUBLICATION IF EXISTS `+pgx.Identifier{n}.Sanitize())
	}
}

// walPool is a migrated schema of the test's own on a server with
// wal_level=logical.
func walPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := outboxtest.Pool(t)
	requireLogical(t, pool)
	return pool
}

func testLogger(t testing.TB) *slog.Logger { return outboxtest.Logger(t) }

// broker is a test's own exchange and queue on the test broker, deleted in
// cleanup, and a consumer recording every delivery (see amqptest.Broker).
type broker struct {
	*amqptest.Broker
	t testing.TB
}

// newBroker declares an exchange and a queue bound to it with keys.
func newBroker(t testing.TB, keys ...string) *broker {
	t.Helper()
	b := &broker{amqptest.NewBroker(t, testAMQPURL(), "outboxwal-test-"), t}
	b.DeclareQueue(nil)
	for _, k := range keys {
		b.Bind(k)
	}
	b.Consume()
	return b
}

// waitIDs waits until every id in want was delivered at least once.
func (b *broker) waitIDs(what string, want []outbox.Enqueued) []amqp.Delivery {
	b.t.Helper()
	var (
		got     []amqp.Delivery
		missing []int64
	)
	deadline := time.Now().Add(longWait)
	for {
		got = b.Deliveries()
		seen := receivedIDs(got)
		missing = missing[:0]
		for _, e := range want {
			if seen[e.ID] == 0 {
				missing = append(missing, e.ID)
			}
		}
		if len(missing) == 0 {
			return got
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("timed out after %v waiting for %s: events %v not delivered", longWait, what, missing)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// checkMessageIDs fails the test unless every delivery of an event of want
// carries the message id Enqueue's answer gives (outbox.MessageID of the id
// and created_at): the WAL stream's decoding, the hand-over relay's reading
// and the writer agree to the microsecond, so a copy from either is the same
// message to an inbox.
func checkMessageIDs(t testing.TB, want []outbox.Enqueued, got []amqp.Delivery) {
	t.Helper()
	byID := make(map[int64]string, len(want))
	for _, e := range want {
		byID[e.ID] = e.MessageID()
	}
	for _, d := range got {
		id, _, err := outbox.ParseMessageID(d.MessageId)
		if err != nil {
			t.Fatalf("delivery %q: %v", d.MessageId, err)
		}
		if w, ok := byID[id]; ok && d.MessageId != w {
			t.Fatalf("event %d published as %q, want %q", id, d.MessageId, w)
		}
	}
}

var receivedIDs = amqptest.ReceivedIDs

// checkAggregateOrder fails the test unless every aggregate's versions first
// appear in order 1, 2, 3... on the queue; copies of a version already seen
// are allowed.
func checkAggregateOrder(t testing.TB, ds []amqp.Delivery) map[string]int64 {
	t.Helper()
	return checkAggregateOrderSkipping(t, ds, nil)
}

// checkAggregateOrderSkipping is checkAggregateOrder where discarded[agg] is a
// version of agg an operator discarded: it is never delivered, and the next
// version may follow the one before it.
func checkAggregateOrderSkipping(t testing.TB, ds []amqp.Delivery, discarded map[string]int64) map[string]int64 {
	t.Helper()
	last := map[string]int64{}
	for _, d := range ds {
		agg, _ := d.Headers["aggregate_id"].(string)
		v, _ := d.Headers["aggregate_version"].(int64)
		if dv, ok := discarded[agg]; ok && v > dv && last[agg] == dv-1 {
			last[agg] = dv
		}
		switch {
		case v <= last[agg]:
		case v == last[agg]+1:
			last[agg] = v
		default:
			t.Fatalf("aggregate %s: version %d delivered before version %d", agg, v, last[agg]+1)
		}
	}
	return last
}

// checkLastCopiesInOrder fails t unless, per aggregate, the last copy of
// each version was delivered after the last copy of the version before it
// (discarded[agg] is a version never delivered: the next one follows the one
// before it), every version from 1 up to the highest delivered was delivered,
// and early copies are allowed: what runs promise when an event of a run
// fails (see the package doc, "Order per aggregate").
func checkLastCopiesInOrder(t testing.TB, ds []amqp.Delivery, discarded map[string]int64) {
	t.Helper()
	last := map[string]map[int64]int{}
	for i, d := range ds {
		agg, _ := d.Headers["aggregate_id"].(string)
		v, _ := d.Headers["aggregate_version"].(int64)
		if last[agg] == nil {
			last[agg] = map[int64]int{}
		}
		last[agg][v] = i
	}
	for agg, vs := range last {
		prev := -1
		for v := int64(1); v <= int64(len(vs))+1; v++ {
			if discarded[agg] == v {
				continue
			}
			i, ok := vs[v]
			if !ok {
				if _, later := vs[v+1]; later {
					t.Fatalf("aggregate %s: version %d never delivered, version %d was", agg, v, v+1)
				}
				break
			}
			if i < prev {
				t.Fatalf("aggregate %s: the last copy of version %d came before the last copy of version %d", agg, v, v-1)
			}
			prev = i
		}
	}
}

func newPublisher(t testing.TB, url, exchange string) *outboxamqp.Publisher {
	t.Helper()
	return amqptest.NewPublisher(t, url, exchange, testLogger(t))
}

// slotCaughtUp is a WaitFor condition: the slot acknowledged every
// transaction committed before the call.
func slotCaughtUp(t testing.TB, pool *pgxpool.Pool, slot string) func() (bool, error) {
	var target string
	if err := pool.QueryRow(context.Background(), "SELECT pg_current_wal_lsn()::text").Scan(&target); err != nil {
		t.Fatal(err)
	}
	return func() (bool, error) {
		var ok bool
		err := pool.QueryRow(context.Background(),
			`SELECT coalesce(confirmed_flush_lsn >= $2::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1`,
			slot, target).Scan(&ok)
		return ok, err
	}
}

func count(t testing.TB, pool *pgxpool.Pool, query string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitSlotFree waits until no WAL sender streams from slot: a stopped
// relay's WAL sender exits a moment after the relay closed its connection.
func waitSlotFree(t testing.TB, pool *pgxpool.Pool, slot string) {
	t.Helper()
	waitFor(t, "the slot free", 30*time.Second, func() (bool, error) {
		return count(t, pool, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active`, slot) == 0, nil
	})
}

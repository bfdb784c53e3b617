package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// childArgs, when set (JSON), makes the test binary the command: the test
// runs the backfill as a child process it can kill.
const childArgs = "BACKFILL_TEST_CHILD_ARGS"

func TestMain(m *testing.M) {
	if a := os.Getenv(childArgs); a != "" {
		var args []string
		if err := json.Unmarshal([]byte(a), &args); err != nil {
			fmt.Fprintln(os.Stderr, "backfill child:", err)
			os.Exit(2)
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		err := run(ctx, args, os.Getenv, os.Stdout)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "backfill:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func databaseURL() string {
	return cmp.Or(os.Getenv("TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
}

func amqpURL() string {
	return cmp.Or(os.Getenv("TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
}

func unavailable(t *testing.T, what string, err error) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s unreachable (required under CI=true): %v", what, err)
	}
	t.Skipf("%s unreachable: %v", what, err)
}

func randomName(prefix string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// outboxSchema makes a schema of the test's own with the outbox tables, and
// returns a pool on it and the database URL that reaches it.
func outboxSchema(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, databaseURL())
	if err != nil {
		unavailable(t, "PostgreSQL", err)
	}
	defer admin.Close(ctx)
	schema := randomName("backfill_test_")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), databaseURL())
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close(context.Background())
		if _, err := c.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Error(err)
		}
	})
	u, err := url.Parse(databaseURL())
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := outbox.MigrateWithConfig(ctx, pool, outbox.MigrateConfig{Logger: slog.New(slog.DiscardHandler)}); err != nil {
		t.Fatal(err)
	}
	return pool, u.String()
}

// consumer records every delivery of one queue.
type consumer struct {
	mu  sync.Mutex
	got []amqp.Delivery
}

func (c *consumer) consume(t *testing.T, ch *amqp.Channel, queue string) {
	t.Helper()
	ds, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for d := range ds {
			c.mu.Lock()
			c.got = append(c.got, d)
			c.mu.Unlock()
		}
	}()
}

func (c *consumer) deliveries() []amqp.Delivery {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]amqp.Delivery(nil), c.got...)
}

// distinct counts the distinct message ids delivered.
func distinct(ds []amqp.Delivery) int {
	seen := map[string]bool{}
	for _, d := range ds {
		seen[d.MessageId] = true
	}
	return len(seen)
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// child is one run of the command as a process of its own.
type child struct {
	cmd    *exec.Cmd
	out    bytes.Buffer
	done   chan struct{}
	waited error
}

func startChild(t *testing.T, dbURL string, args ...string) *child {
	t.Helper()
	a, err := json.Marshal(args)
	if err != nil {
		t.Fatal(err)
	}
	c := &child{done: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], "-test.run=^$")
	c.cmd.Env = append(os.Environ(), childArgs+"="+string(a), "DATABASE_URL="+dbURL, "AMQP_URL="+amqpURL(), "LOG_LEVEL=info")
	c.cmd.Stdout, c.cmd.Stderr = &c.out, &c.out
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { c.waited = c.cmd.Wait(); close(c.done) }()
	t.Cleanup(func() {
		_ = c.cmd.Process.Kill()
		<-c.done
	})
	return c
}

func (c *child) wait(t *testing.T, timeout time.Duration) error {
	t.Helper()
	select {
	case <-c.done:
		return c.waited
	case <-time.After(timeout):
		t.Fatalf("the backfill did not exit within %v; its output:\n%s", timeout, c.out.String())
		return nil
	}
}

// checkpoint reads the backfill's checkpoint: replayed, total (-1 while
// not counted), finished; ok false while there is none.
func checkpoint(pool *pgxpool.Pool, name string) (replayed, total int64, finished, ok bool, err error) {
	var tot *int64
	err = pool.QueryRow(context.Background(),
		`SELECT replayed, total, finished_at IS NOT NULL FROM outbox_backfill WHERE name = $1`, name).Scan(&replayed, &tot, &finished)
	if errors.Is(err, pgx.ErrNoRows) || err != nil && strings.Contains(err.Error(), "does not exist") {
		return 0, 0, false, false, nil
	}
	if err != nil {
		return 0, 0, false, false, err
	}
	total = -1
	if tot != nil {
		total = *tot
	}
	return replayed, total, finished, true, nil
}

// TestBackfillHandsOverToTheLiveFlow adds a consumer's queue while 20,000
// events flow through the real relay, replays the archive to it with the
// command, stopped with SIGTERM at a quarter and killed with SIGKILL at half
// of it, then run to its end; the new consumer must then hold every event
// (after deduplication by message id), the replayed copies of each
// aggregate in version order and the same messages as the live ones, and
// the old consumer exactly its live deliveries.
func TestBackfillHandsOverToTheLiveFlow(t *testing.T) {
	const (
		events     = 20_000
		aggregates = 200
		perTx      = 4
		bindAt     = 7_000 // events written before the new queue is bound
		batch      = 100
		lease      = 10 * time.Second // the relay's; long enough that a loaded machine does not make the relay duplicate
	)
	pool, dbURL := outboxSchema(t)
	ctx := context.Background()

	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		unavailable(t, "RabbitMQ", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	exchange := randomName("backfill-test-")
	oldQueue, newQueue := exchange+".old", exchange+".new"
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range []string{oldQueue, newQueue} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		_ = ch.ExchangeDelete(exchange, false, false)
	})
	bind := func(q string, c *consumer) {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(q, "#", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
		c.consume(t, ch, q)
	}
	var oldC, newC consumer
	bind(oldQueue, &oldC)

	// The live flow: a relay, and a writer at about 700 events a second.
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: amqpURL(), Exchange: exchange, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{
		BatchSize: 200, PollInterval: 20 * time.Millisecond, Lease: lease, PublishTimeout: lease / 2,
		RetryBackoffMin: 10 * time.Millisecond, RetryBackoffMax: 200 * time.Millisecond,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	defer func() {
		stopRelay()
		if err := <-relayDone; err != nil {
			t.Errorf("relay: %v", err)
		}
		_ = pub.Close()
	}()

	var written sync.WaitGroup
	writeErr := make(chan error, 1)
	var mu sync.Mutex
	n := 0
	written.Add(1)
	go func() {
		defer written.Done()
		tick := time.NewTicker(perTx * time.Second / 700)
		defer tick.Stop()
		for i := 0; i < events/perTx; i++ {
			<-tick.C
			agg := fmt.Sprintf("o-%03d", i%aggregates)
			msgs := make([]outbox.Message, perTx)
			for j := range msgs {
				msgs[j] = outbox.Message{AggregateType: "order", AggregateID: agg, EventType: "order.changed",
					Payload: []byte(fmt.Sprintf(`{"n":%d}`, i*perTx+j)), Headers: map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
			}
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return outbox.Enqueue(ctx, tx, msgs...)
			})
			if err != nil {
				writeErr <- err
				return
			}
			relay.Wake()
			mu.Lock()
			n += perTx
			mu.Unlock()
		}
	}()
	waitFor(t, "the first events", 120*time.Second, func() (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		select {
		case err := <-writeErr:
			return false, err
		default:
		}
		return n >= bindAt, nil
	})

	// A service is added: its queue is bound, then the backfill starts.
	bind(newQueue, &newC)
	args := []string{"-queue", newQueue, "-rate", "1000", "-batch", fmt.Sprint(batch), "-progress", "1s"}
	reached := func(frac float64) func() (bool, error) {
		return func() (bool, error) {
			replayed, total, finished, ok, err := checkpoint(pool, newQueue)
			if finished {
				return false, errors.New("the backfill finished before it could be stopped")
			}
			return ok && total > 0 && float64(replayed) >= frac*float64(total), err
		}
	}
	first := startChild(t, dbURL, args...)
	waitFor(t, "a quarter of the replay", 120*time.Second, reached(0.25))
	if err := first.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = first.wait(t, 30*time.Second)
	if ee, ok := errors.AsType[*exec.ExitError](err); !ok || ee.ExitCode() != 1 || !strings.Contains(first.out.String(), "run again to go on") {
		t.Fatalf("after SIGTERM the backfill exited with %v, want exit status 1 saying where it stopped; its output:\n%s", err, first.out.String())
	}
	t.Logf("first run, stopped by SIGTERM:\n%s", first.out.String())

	second := startChild(t, dbURL, args...)
	waitFor(t, "half of the replay", 120*time.Second, reached(0.5))
	if err := second.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = second.wait(t, 30*time.Second)
	t.Logf("second run, killed:\n%s", second.out.String())

	third := startChild(t, dbURL, args...)
	if err := third.wait(t, 180*time.Second); err != nil {
		t.Fatalf("the last run: %v; its output:\n%s", err, third.out.String())
	}
	t.Logf("third run:\n%s", third.out.String())
	replayed, total, finished, _, err := checkpoint(pool, newQueue)
	if err != nil || !finished || replayed != total {
		t.Fatalf("checkpoint after the last run: replayed %d of %d, finished %v (%v)", replayed, total, finished, err)
	}

	written.Wait()
	select {
	case err := <-writeErr:
		t.Fatalf("writer: %v", err)
	default:
	}
	waitFor(t, "every event delivered to both queues", 180*time.Second, func() (bool, error) {
		return distinct(oldC.deliveries()) >= events && distinct(newC.deliveries()) >= events, nil
	})
	time.Sleep(2 * time.Second) // let extras, if any, arrive

	// The audit: every archived event, by its message id.
	rows, err := pool.Query(ctx, `SELECT id, created_at FROM outbox_published`)
	if err != nil {
		t.Fatal(err)
	}
	archived := map[string]bool{}
	for rows.Next() {
		var id int64
		var at time.Time
		if err := rows.Scan(&id, &at); err != nil {
			t.Fatal(err)
		}
		archived[outbox.MessageID(id, at)] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(archived) != events {
		t.Fatalf("%d events archived, want %d", len(archived), events)
	}

	// The old consumer: each event exactly once, nothing from the replay.
	oldDs := oldC.deliveries()
	oldCount := map[string]int{}
	for _, d := range oldDs {
		oldCount[d.MessageId]++
	}
	for id := range archived {
		if oldCount[id] != 1 {
			t.Errorf("the old queue got event %s %d times, want once", id, oldCount[id])
		}
	}
	if len(oldDs) != events {
		t.Errorf("the old queue got %d deliveries for %d events: the replay reached it, or the relay duplicated", len(oldDs), events)
	}

	// The new consumer: every event after deduplication; the replayed
	// copies (through the default exchange) like the live ones, and in
	// version order per aggregate, stepping back only where a run resumed.
	newDs := newC.deliveries()
	live, replay := map[string]amqp.Delivery{}, map[string]int{}
	nextReplayed := map[string]int64{}
	var replayedRaw int
	for _, d := range newDs {
		if !archived[d.MessageId] {
			t.Errorf("the new queue got message %s, which is not an archived event", d.MessageId)
			continue
		}
		if d.Exchange == exchange {
			live[d.MessageId] = d
			continue
		}
		if d.Exchange != "" {
			t.Fatalf("delivery from exchange %q", d.Exchange)
		}
		replayedRaw++
		replay[d.MessageId]++
		agg, _ := d.Headers["aggregate_id"].(string)
		v, _ := d.Headers["aggregate_version"].(int64)
		if want := max(nextReplayed[agg], 1); v > want {
			t.Errorf("replayed %s version %d before version %d", agg, v, want)
		}
		nextReplayed[agg] = max(nextReplayed[agg], v+1)
	}
	overlap := 0
	for id := range archived {
		if live[id].MessageId == "" && replay[id] == 0 {
			t.Errorf("the new queue never got event %s", id)
		}
		if live[id].MessageId != "" && replay[id] > 0 {
			overlap++
		}
	}
	for _, d := range newDs {
		l, ok := live[d.MessageId]
		if d.Exchange != "" || !ok {
			continue
		}
		if string(l.Body) != string(d.Body) || fmt.Sprint(l.Headers) != fmt.Sprint(d.Headers) || l.Type != d.Type || !l.Timestamp.Equal(d.Timestamp) {
			t.Errorf("event %s replayed as %s %v, live as %s %v", d.MessageId, d.Body, d.Headers, l.Body, l.Headers)
		}
	}
	t.Logf("new queue: %d deliveries, %d live, %d replayed (%d events, %d created up to Until), %d events both live and replayed",
		len(newDs), len(newDs)-replayedRaw, replayedRaw, len(replay), total, overlap)
	if int64(len(replay)) != total {
		t.Errorf("%d distinct events replayed, the checkpoint counts %d", len(replay), total)
	}
	// Two interrupted runs: each sends again at most the batch in flight.
	if limit := total + 2*batch; int64(replayedRaw) > limit {
		t.Errorf("%d replayed deliveries for %d events: a resumed run did not start from the checkpoint (at most %d)", replayedRaw, total, limit)
	}
	if overlap == 0 {
		t.Errorf("no event came both live and replayed: the test did not exercise the seam")
	}
}

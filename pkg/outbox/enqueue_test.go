package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

func countRows(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox").Scan(&n); err != nil {
		t.Fatalf("count outbox: %v", err)
	}
	return n
}

func TestEnqueueWritesRowsWithVersionsAndHeaders(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	var got []outbox.Enqueued
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		got, err = new(outbox.Writer).Enqueue(ctx, tx, msg("o-1", "order.created"), msg("o-1", "order.cancelled"), msg("o-2", "order.created"))
		return err
	})
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	wantVersions := []int64{1, 2, 1}
	for i, e := range got {
		if e.AggregateVersion != wantVersions[i] {
			t.Errorf("message %d: version %d, want %d", i, e.AggregateVersion, wantVersions[i])
		}
	}
	if !(got[0].ID < got[1].ID && got[1].ID < got[2].ID) {
		t.Errorf("ids not increasing in enqueue order: %+v", got)
	}

	var payload, traceparent, eventType string
	var attempts int
	err = pool.QueryRow(ctx, `SELECT payload->>'order_id', headers->>'traceparent', event_type, attempts
		FROM outbox WHERE id = $1`, got[1].ID).Scan(&payload, &traceparent, &eventType, &attempts)
	if err != nil {
		t.Fatalf("read row: %v", err)
	}
	if payload != "o-1" || eventType != "order.cancelled" || attempts != 0 ||
		traceparent != "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" {
		t.Errorf("row = payload %q event %q attempts %d traceparent %q", payload, eventType, attempts, traceparent)
	}

	// A later transaction continues the aggregate's versions.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		got, err = new(outbox.Writer).Enqueue(ctx, tx, msg("o-1", "order.shipped"))
		return err
	})
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	if got[0].AggregateVersion != 3 {
		t.Errorf("third event of o-1 got version %d, want 3", got[0].AggregateVersion)
	}
}

func TestEnqueueRolledBackLeavesNothing(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	injected := errors.New("injected failure after enqueue")
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := outbox.Enqueue(ctx, tx, msg("o-1", "order.created")); err != nil {
			return err
		}
		return injected
	})
	if !errors.Is(err, injected) {
		t.Fatalf("BeginFunc error = %v, want the injected one", err)
	}
	if n := countRows(t, pool); n != 0 {
		t.Fatalf("outbox has %d rows after rollback, want 0", n)
	}
	// The version counter rolled back too: the next event is still version 1.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		got, err := new(outbox.Writer).Enqueue(ctx, tx, msg("o-1", "order.created"))
		if err == nil && got[0].AggregateVersion != 1 {
			return fmt.Errorf("version after rollback = %d, want 1", got[0].AggregateVersion)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestEnqueueRejectsInvalidMessagesAndWritesNothing(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	valid := msg("o-1", "order.created")
	cases := map[string]func(m *outbox.Message){
		"empty aggregate type": func(m *outbox.Message) { m.AggregateType = "" },
		"empty aggregate id":   func(m *outbox.Message) { m.AggregateID = "" },
		"empty event type":     func(m *outbox.Message) { m.EventType = "" },
		"payload not JSON":     func(m *outbox.Message) { m.Payload = []byte(`{"a":`) },
		"empty payload":        func(m *outbox.Message) { m.Payload = nil },
		"NUL in payload":       func(m *outbox.Message) { m.Payload = []byte(`{"a":"x\u0000y"}`) },
		"NUL in aggregate id":  func(m *outbox.Message) { m.AggregateID = "o\x00" },
		"invalid UTF-8":        func(m *outbox.Message) { m.EventType = "order.\xff" },
		"NUL in header":        func(m *outbox.Message) { m.Headers = map[string]string{"k": "v\x00"} },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			bad := valid
			mutate(&bad)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				// The valid message comes first: the bad one must stop both.
				return outbox.Enqueue(ctx, tx, valid, bad)
			})
			if !errors.Is(err, outbox.ErrInvalidMessage) {
				t.Fatalf("error = %v, want ErrInvalidMessage", err)
			}
		})
	}
	if n := countRows(t, pool); n != 0 {
		t.Fatalf("outbox has %d rows, want 0", n)
	}
}

// Concurrent writers of one aggregate get gapless versions, in the order of
// their ids: the property the relay's per-aggregate ordering rests on.
func TestEnqueueConcurrentWritersOfOneAggregateAreSerialised(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	const writers = 20
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if err := outbox.Enqueue(ctx, tx, msg("hot", "order.touched")); err != nil {
					return err
				}
				// Hold the aggregate a little, so writers really overlap.
				_, err := tx.Exec(ctx, "SELECT pg_sleep(0.005)")
				return err
			})
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("writer: %v", err)
		}
	}

	rows, err := pool.Query(ctx, "SELECT aggregate_version FROM outbox ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if len(versions) != writers {
		t.Fatalf("%d rows, want %d", len(versions), writers)
	}
	for i, v := range versions {
		if v != int64(i+1) {
			t.Fatalf("row %d in id order has version %d, want %d (versions %v)", i, v, i+1, versions)
		}
	}
}

func TestWriterNotifiesOnCommitOnly(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	channel := "outbox_test_notify"
	w, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: channel})
	if err != nil {
		t.Fatal(err)
	}
	listener, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Release()
	if _, err := listener.Exec(ctx, "LISTEN "+channel); err != nil {
		t.Fatal(err)
	}

	// Rolled back: no notification.
	_ = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := w.Enqueue(ctx, tx, msg("o-1", "order.created")); err != nil {
			return err
		}
		return errors.New("roll back")
	})
	short, cancelShort := context.WithTimeout(ctx, 200*time.Millisecond)
	if n, err := listener.Conn().WaitForNotification(short); err == nil {
		t.Fatalf("got notification %+v for a rolled back transaction", n)
	}
	cancelShort()

	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := w.Enqueue(ctx, tx, msg("o-1", "order.created"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	n, err := listener.Conn().WaitForNotification(ctx)
	if err != nil {
		t.Fatalf("no notification after commit: %v", err)
	}
	if n.Channel != channel {
		t.Fatalf("notification on %q, want %q", n.Channel, channel)
	}
}

func TestNewWriterRejectsBadChannel(t *testing.T) {
	t.Parallel()
	if _, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: "a\x00b"}); err == nil {
		t.Fatal("NUL in channel accepted")
	}
}

func TestMigrateConcurrentlyAndTwice(t *testing.T) {
	t.Parallel()
	pool := newSchemaPool(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = outbox.Migrate(ctx, pool)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("concurrent migrate: %v", err)
		}
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		t.Fatalf("second migrate: %v", err)
	}
	if n := countRows(t, pool); n != 0 {
		t.Fatalf("fresh outbox has %d rows", n)
	}
}

func TestQueueSendsMessagesInTheCallersBatch(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE business (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	w, err := outbox.NewWriter(outbox.WriterConfig{NotifyChannel: "queue_test"})
	if err != nil {
		t.Fatal(err)
	}

	// The business insert and the messages go in one batch, in one transaction.
	var got []outbox.Enqueued
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO business (id) VALUES ('o-1')`)
		q, err := w.Queue(b, msg("o-1", "order.created"), msg("o-1", "order.cancelled"))
		if err != nil {
			return err
		}
		if b.Len() != 6 { // the business insert, two statements per message, the NOTIFY
			return fmt.Errorf("batch holds %d statements, want 6", b.Len())
		}
		if _, err := q.Enqueued(); err == nil {
			return errors.New("Enqueued before the batch was sent returned no error")
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
		got, err = q.Enqueued()
		return err
	})
	if err != nil {
		t.Fatalf("transaction: %v", err)
	}
	if len(got) != 2 || got[0].AggregateVersion != 1 || got[1].AggregateVersion != 2 || got[0].ID >= got[1].ID {
		t.Fatalf("Enqueued = %+v, want versions 1 and 2 in increasing ids", got)
	}
	if n := countRows(t, pool); n != 2 {
		t.Fatalf("outbox has %d rows, want 2", n)
	}

	// A failing business statement after the messages rolls them back.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		if _, err := w.Queue(b, msg("o-1", "order.shipped")); err != nil {
			return err
		}
		b.Queue(`INSERT INTO business (id) VALUES ('o-1')`) // duplicate key
		return tx.SendBatch(ctx, b).Close()
	})
	if err == nil {
		t.Fatal("batch with a duplicate business key committed")
	}
	if n := countRows(t, pool); n != 2 {
		t.Fatalf("outbox has %d rows after the failed batch, want 2", n)
	}

	// An invalid message queues nothing.
	b := &pgx.Batch{}
	bad := msg("o-2", "order.created")
	bad.Payload = []byte("not json")
	if _, err := w.Queue(b, msg("o-2", "order.created"), bad); !errors.Is(err, outbox.ErrInvalidMessage) {
		t.Fatalf("Queue(invalid) error = %v, want ErrInvalidMessage", err)
	}
	if b.Len() != 0 {
		t.Fatalf("batch holds %d statements after an invalid message, want 0", b.Len())
	}

	// The next version of the aggregate follows the committed ones.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		got, err = w.Enqueue(ctx, tx, msg("o-1", "order.shipped"))
		return err
	})
	if err != nil || got[0].AggregateVersion != 3 {
		t.Fatalf("Enqueue after the rollback: %+v, %v; want version 3", got, err)
	}
}

// A message the broker cannot take must not reach the outbox: amqp091 closes
// the whole connection on a short string over 255 bytes (the event type is the
// message's type and default routing key; header names are table keys),
// RabbitMQ the channel on a CC or BCC header that is not a list, and the
// connection on a content header frame over its frame_max, which the headers
// fill as an encoded AMQP table, not as text. Each limit is checked by
// Enqueue and by Writer.Queue, which then write or queue nothing.
func TestEnqueueRejectsMessagesTheBrokerCannotTake(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()

	long := func(n int) string { return strings.Repeat("x", n) }
	jsonOfSize := func(n int) []byte { return []byte(`"` + long(n-2) + `"`) }
	valid := msg("o-1", "order.created")
	cases := map[string]func(m *outbox.Message){
		"event type over 255 bytes":     func(m *outbox.Message) { m.EventType = long(256) },
		"aggregate type over 255 bytes": func(m *outbox.Message) { m.AggregateType = long(256) },
		"header name over 255 bytes":    func(m *outbox.Message) { m.Headers = map[string]string{long(256): "v"} },
		"header values over 64 KiB":     func(m *outbox.Message) { m.Headers = map[string]string{"baggage": long(64 << 10)} },
		"aggregate id over 64 KiB":      func(m *outbox.Message) { m.AggregateID = long(64 << 10) },
		// RabbitMQ reads CC and BCC as lists of routing keys: 406
		// unacceptable_type_in_header on a string, the channel closed.
		"header CC":  func(m *outbox.Message) { m.Headers = map[string]string{"CC": "audit"} },
		"header BCC": func(m *outbox.Message) { m.Headers = map[string]string{"BCC": "audit"} },
		// 60 KB of text, 150 KB as an AMQP table: over RabbitMQ's frame_max
		// (501 FRAME_ERROR, the connection closed).
		"15,000 header names of 4 bytes": func(m *outbox.Message) { m.Headers = names(15_000, 4) },
		"headers under 64 KiB as text, over it encoded": func(m *outbox.Message) {
			m.Headers = names(6000, 8) // 48,000 bytes of names, 84,000 encoded
		},
		"payload over 1 MiB": func(m *outbox.Message) { m.Payload = jsonOfSize(1<<20 + 1) },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			bad := valid
			mutate(&bad)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				err := outbox.Enqueue(ctx, tx, valid, bad)
				if !errors.Is(err, outbox.ErrInvalidMessage) {
					return fmt.Errorf("Enqueue error = %v, want ErrInvalidMessage", err)
				}
				// Nothing was written, not even the valid message before it.
				var rows, aggregates int
				if err := tx.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox_aggregates)`).
					Scan(&rows, &aggregates); err != nil {
					return err
				}
				if rows != 0 || aggregates != 0 {
					return fmt.Errorf("transaction wrote %d outbox rows and %d aggregates, want none", rows, aggregates)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			b := &pgx.Batch{}
			if _, err := (&outbox.Writer{}).Queue(b, valid, bad); !errors.Is(err, outbox.ErrInvalidMessage) {
				t.Fatalf("Queue error = %v, want ErrInvalidMessage", err)
			}
			if b.Len() != 0 {
				t.Fatalf("batch holds %d statements, want 0", b.Len())
			}
		})
	}

	// Right at each limit, the message is written.
	atLimits := valid
	atLimits.EventType = long(255)
	atLimits.AggregateType = long(255)
	atLimits.Headers = map[string]string{long(255): "v"}
	atLimits.Payload = jsonOfSize(1 << 20)
	if got := enqueue(t, pool, atLimits); len(got) != 1 {
		t.Fatalf("enqueued %d messages at the limits, want 1", len(got))
	}
}

// names returns n headers with distinct names of size bytes and empty values.
func names(n, size int) map[string]string {
	h := make(map[string]string, n)
	for i := range n {
		h[fmt.Sprintf("%0*x", size, i)] = ""
	}
	return h
}

// The headers are measured as the AMQP field table a publisher sends: the
// table's length, then per entry a short-string name, a type byte and the
// value, with the four headers every publisher adds (a same-named header of
// the message is replaced, not counted twice).
func TestHeaderBytesMeasuresTheEncodedTable(t *testing.T) {
	t.Parallel()
	base := outbox.Message{AggregateType: "order", AggregateID: "o-1", EventType: "order.created"}
	// 4 (table) + aggregate_type 1+14+1+4+5 + aggregate_id 1+12+1+4+3
	// + event_type 1+10+1+4+13 + aggregate_version 1+17+1+8
	// + outbox_created_at 1+17+1+4+30
	const reserved = 4 + 25 + 21 + 29 + 27 + 53
	for name, c := range map[string]struct {
		headers map[string]string
		want    int
	}{
		"no headers":              {nil, reserved},
		"one header":              {map[string]string{"a": "bc"}, reserved + 1 + 1 + 1 + 4 + 2},
		"empty name and value":    {map[string]string{"": ""}, reserved + 1 + 0 + 1 + 4 + 0},
		"a reserved name":         {map[string]string{"event_type": "spoofed"}, reserved},
		"multi-byte text (bytes)": {map[string]string{"é": "日本"}, reserved + 1 + 2 + 1 + 4 + 6},
		"15,000 names of 4 bytes": {names(15_000, 4), reserved + 15_000*(1+4+1+4)},
	} {
		m := base
		m.Headers = c.headers
		if got := outbox.HeaderBytes(m); got != c.want {
			t.Errorf("%s: %d bytes, want %d", name, got, c.want)
		}
	}
}

func TestWriterMaxPayloadBytes(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	if _, err := outbox.NewWriter(outbox.WriterConfig{MaxPayloadBytes: -2}); err == nil {
		t.Fatal("MaxPayloadBytes -2 accepted")
	}
	payload := func(n int) outbox.Message {
		m := msg("o-1", "order.created")
		m.Payload = []byte(`"` + strings.Repeat("x", n-2) + `"`)
		return m
	}
	small, err := outbox.NewWriter(outbox.WriterConfig{MaxPayloadBytes: 100})
	if err != nil {
		t.Fatal(err)
	}
	unlimited, err := outbox.NewWriter(outbox.WriterConfig{MaxPayloadBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		w    *outbox.Writer
		size int
		ok   bool
	}{
		{small, 100, true},
		{small, 101, false},
		{unlimited, outbox.DefaultMaxPayloadBytes + 1, true},
	} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := tc.w.Enqueue(ctx, tx, payload(tc.size))
			return err
		})
		if tc.ok && err != nil {
			t.Errorf("payload of %d bytes: %v", tc.size, err)
		}
		if !tc.ok && !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Errorf("payload of %d bytes over a limit of 100: error %v, want ErrInvalidMessage", tc.size, err)
		}
	}
	if n := countRows(t, pool); n != 2 {
		t.Fatalf("outbox has %d rows, want the 2 accepted", n)
	}
}

package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// Recorder is a Publisher that confirms every message and keeps it by id,
// for tests that wait for one event.
type Recorder struct {
	mu    sync.Mutex
	got   map[int64]outbox.Envelope
	order []outbox.Envelope
	wake  chan struct{}
}

// NewRecorder returns an empty Recorder.
func NewRecorder() *Recorder {
	return &Recorder{got: map[int64]outbox.Envelope{}, wake: make(chan struct{})}
}

// WaitReady implements outbox.Publisher.
func (r *Recorder) WaitReady(ctx context.Context) error { return ctx.Err() }

// PublishBatch implements outbox.Publisher: every message is confirmed.
func (r *Recorder) PublishBatch(_ context.Context, msgs []outbox.Envelope) []error {
	r.mu.Lock()
	for _, m := range msgs {
		r.got[m.ID] = m
		r.order = append(r.order, m)
	}
	close(r.wake)
	r.wake = make(chan struct{})
	r.mu.Unlock()
	return make([]error, len(msgs))
}

// Published returns every message published, copies included, in the order
// the publisher got them.
func (r *Recorder) Published() []outbox.Envelope {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.order)
}

// Distinct returns how many distinct events were published.
func (r *Recorder) Distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// Wait returns the envelope of event id once published, or false after
// timeout.
func (r *Recorder) Wait(id int64, timeout time.Duration) (outbox.Envelope, bool) {
	deadline := time.After(timeout)
	for {
		r.mu.Lock()
		e, ok := r.got[id]
		wake := r.wake
		r.mu.Unlock()
		if ok {
			return e, true
		}
		select {
		case <-wake:
		case <-deadline:
			return outbox.Envelope{}, false
		}
	}
}

// FuzzSeeds adds the inputs every fuzz target of a message starts from:
// (aggregate id, event type, payload, header name, header value).
func FuzzSeeds(f *testing.F) {
	for _, s := range [][5]string{
		{"o-1", "order.created", `{"order_id":"o-1","total":12.5}`, "traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		{"o-2", "order.created", `[1e131071]`, "", ""},
		{"o-3", "order.created", `[1e131071,1e131071,1e131071,1e131071,1e131071,1e131071,1e131071,1e131071]`, "", ""},
		{"o-4", "order.created", `-0.000e-16380`, "k", ""},
		{"o-5", "order.created", `1e-16384`, "k", "v"},
		{"o-6", "order.created", `"\ud83d\ude00 \ud800"`, "", ""},
		{"o-7", "order.created", `"\\u0000 is text, \u0000 is not"`, "", ""},
		{"o-8", "order.created", strings.Repeat("[", 3000) + strings.Repeat("]", 3000), "", ""},
		{"o-9", "order.created", `{"a":1,"a":2," ":"\t\n\"\\\/\b\f\u001f\u007f\u2028"}`, "é", "\x7f\u2028"},
		{"o-10", "order.created", `"` + strings.Repeat("x", 100_000) + `"`, "CC", "q"},
		{"o\x00", "order.created", `{}`, "", ""},
		{"o-12", strings.Repeat("e", 256), `{}`, "", ""},
		{"o-13", "order.created", `{}`, "aggregate_version", "7"},
		{"o-14", "order.created", "\"\xff\"", "", ""},
		{"o-15", "order.created", `{}`, "h", strings.Repeat("v", 70_000)},
		// At the default payload limit (1 MiB), as given and as printed;
		// too large for the committed corpus, made here.
		{"o-16", "order.created", `"` + strings.Repeat("x", 1<<20-2) + `"`, "", ""},
		{"o-17", "order.created", `"` + strings.Repeat("x", 1<<20-1) + `"`, "", ""},
		{"o-18", "order.created", "[" + strings.Repeat("1,", 349_524) + "1]", "", ""},
		{"o-19", "order.created", "[" + strings.Repeat("1,", 349_525) + "1]", "", ""},
	} {
		f.Add(s[0], s[1], []byte(s[2]), s[3], s[4])
	}
}

// FuzzMessage is the message a fuzz input stands for.
func FuzzMessage(aggregateID, eventType string, payload []byte, headerName, headerValue string) outbox.Message {
	m := outbox.Message{AggregateType: "order", AggregateID: aggregateID, EventType: eventType, Payload: payload}
	if headerName != "" || headerValue != "" {
		m.Headers = map[string]string{headerName: headerValue}
	}
	return m
}

// PublishedOrRefused enqueues m on pool, where a relay that publishes to rec
// runs, and fails t unless Enqueue either refuses m with ErrInvalidMessage
// having written nothing, or accepts it and the relay publishes it within
// timeout (wake, when not nil, wakes it), with its payload as jsonb prints it and its headers. It returns
// the published envelope, or false when m was refused.
func PublishedOrRefused(t *testing.T, pool *pgxpool.Pool, rec *Recorder, m outbox.Message, timeout time.Duration, wake func()) (outbox.Envelope, bool) {
	t.Helper()
	ctx := context.Background()
	count := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_aggregates`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := count()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	enq, err := new(outbox.Writer).Enqueue(ctx, tx, m)
	if err != nil {
		if !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Fatalf("Enqueue: %v, want ErrInvalidMessage or success", err)
		}
		// Refused before any statement ran: the transaction is intact.
		if cerr := tx.Commit(ctx); cerr != nil {
			t.Fatalf("Enqueue refused the message (%v), and then the transaction could not commit: %v", err, cerr)
		}
		if after := count(); after != before {
			t.Fatalf("Enqueue refused the message, yet wrote %d aggregate rows", after-before)
		}
		return outbox.Envelope{}, false
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if wake != nil {
		wake()
	}
	env, ok := rec.Wait(enq[0].ID, timeout)
	if !ok {
		t.Fatalf("event %d (payload of %d bytes) accepted by Enqueue, not published within %v", enq[0].ID, len(m.Payload), timeout)
	}
	var want string
	if err := pool.QueryRow(ctx, `SELECT $1::jsonb::text`, string(m.Payload)).Scan(&want); err != nil {
		t.Fatal(err)
	}
	if string(env.Payload) != want {
		t.Fatalf("published payload (%d bytes) is not jsonb's text of the input (%d bytes)", len(env.Payload), len(want))
	}
	if env.AggregateID != m.AggregateID || env.EventType != m.EventType {
		t.Fatalf("published %q/%q, want %q/%q", env.AggregateID, env.EventType, m.AggregateID, m.EventType)
	}
	wantHeaders := maps.Clone(m.Headers)
	if wantHeaders == nil {
		wantHeaders = map[string]string{}
	}
	if !maps.Equal(env.Headers, wantHeaders) {
		t.Fatalf("published headers %s, want %s", fmt.Sprint(env.Headers), fmt.Sprint(wantHeaders))
	}
	return env, true
}

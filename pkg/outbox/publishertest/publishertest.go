// Package publishertest is the conformance kit of outbox.Publisher: the
// checks any publisher must pass, for any broker, before a relay may drive
// it. A publisher's test gives Run a Harness (a way to build the publisher
// against a destination of its own on a real broker and to read back what
// the broker stored), and Run checks the points of the contract in
// pkg/outbox/publisher.go that a broker can show:
//
//	Envelope        message id, headers (the envelope's over same-named free ones) and payload carried
//	Durable         nil only for a message the broker already holds, when the call returns
//	Order           one aggregate's envelopes of a batch stored in batch order
//	Concurrent      batches published at once, each message stored and confirmed
//	Duplicate       a message published again (same id) confirmed, not failed
//	PerMessage      a refused message fails alone; the others of its batch are confirmed
//	Unroutable      a message with nowhere to go fails, wrapping outbox.ErrUnroutable
//	Refused         a message the broker refuses (a nack) fails, not as ErrNotSent
//	Closed          after Close, WaitReady and PublishBatch fail at once, nothing stored
//	EndedContext    a context already ended: PublishBatch returns at once, no nil unstored
//	Deadline        no reply from the broker: PublishBatch returns by the deadline, every message failed, none as ErrNotSent; then it recovers
//	ConnectionCut   connections cut during a batch: no nil unstored; WaitReady reconnects
//
// A check the harness cannot support (a broker with no nack, a harness
// without a Link to cut) is skipped with the reason, never passed: run the
// tests with -v to see which.
package publishertest

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// The event types the kit publishes. A Harness's destination stores every
// EventStored message; it has no route at all for EventUnroutable (when
// Harness.Unroutable), and refuses every EventRefused message (when
// Harness.Refuses). Publishers derive the routing from the event type by
// default (a routing key, a subject): a harness configures its publisher so.
const (
	EventStored     = "kit.stored"
	EventUnroutable = "kit.unroutable"
	EventRefused    = "kit.refused"
)

// Harness is what Run needs of one broker.
type Harness struct {
	// New returns a publisher and a destination of their own on the broker
	// for one check, e.g. an exchange and a queue, or a stream; the
	// harness removes them with t.Cleanup. Required.
	New func(t *testing.T) Target
	// Unroutable: the broker tells the publisher that an EventUnroutable
	// message has nowhere to go (RabbitMQ's basic.return of a mandatory
	// message, JetStream's "no responders").
	Unroutable bool
	// Refuses: the broker refuses every EventRefused message (a nack; an
	// error acknowledgement).
	Refuses bool
	// Deduplicates: the broker keeps one copy of a message published twice
	// under one message id (JetStream's Nats-Msg-Id); without it, the kit
	// accepts one copy or two.
	Deduplicates bool
}

// Target is one check's publisher and destination.
type Target struct {
	// Publisher is the publisher under test, not connected yet. Required.
	Publisher outbox.Publisher
	// Close closes it (its Close method). Required.
	Close func() error
	// Stored returns every message the broker holds in the destination, in
	// the order it stored them, from the first: what was stored at the
	// moment of the call, without waiting for more. Required.
	Stored func(ctx context.Context) ([]Message, error)
	// Link, when set, is the network between the publisher and the broker:
	// the publisher connects through it. Without one, the Deadline and
	// ConnectionCut checks are skipped.
	Link Link
}

// Link is the network between a publisher and its broker, as a test's TCP
// proxy can make it.
type Link interface {
	// CutAll closes every connection through the link; new ones are
	// accepted.
	CutAll()
	// DropReplies, while on, swallows what the broker sends.
	DropReplies(on bool)
}

// Message is a message as the broker stored it.
type Message struct {
	// ID is the message id it was published under.
	ID string
	// Headers holds its headers, each value in its text form (an integer in
	// decimal).
	Headers map[string]string
	// Body is its payload.
	Body []byte
}

// Run runs every check on h, each a subtest with a Target of its own, one
// after the other.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h.New == nil {
		t.Fatal("publishertest: Harness.New is required")
	}
	k := &kit{h: h}
	checks := []struct {
		name  string
		needs string // why it cannot run, or ""
		run   func(*testing.T, *target)
	}{
		{"Envelope", "", k.envelope},
		{"Durable", "", k.durable},
		{"Order", "", k.order},
		{"Concurrent", "", k.concurrent},
		{"Duplicate", "", k.duplicate},
		{"PerMessage", unless(h.Refuses || h.Unroutable, "the broker neither refuses nor returns a message (Harness.Refuses, Harness.Unroutable)"), k.perMessage},
		{"Unroutable", unless(h.Unroutable, "the broker does not tell an unroutable message (Harness.Unroutable)"), k.unroutable},
		{"Refused", unless(h.Refuses, "the broker cannot be made to refuse a message (Harness.Refuses)"), k.refused},
		{"Closed", "", k.closed},
		{"EndedContext", "", k.endedContext},
		{"Deadline", "", k.deadline},
		{"ConnectionCut", "", k.connectionCut},
	}
	for _, c := range checks {
		t.Run(c.name, func(t *testing.T) {
			if c.needs != "" {
				t.Skipf("publishertest: not checked: %s", c.needs)
			}
			c.run(t, k.target(t))
		})
	}
}

func unless(ok bool, why string) string {
	if ok {
		return ""
	}
	return why
}

type kit struct {
	h Harness
}

// target is a Target with the kit's bookkeeping.
type target struct {
	Target
	t    *testing.T
	next int64 // the next outbox id
}

func (k *kit) target(t *testing.T) *target {
	t.Helper()
	tg := k.h.New(t)
	if tg.Publisher == nil || tg.Close == nil || tg.Stored == nil {
		t.Fatal("publishertest: Target.Publisher, Close and Stored are required")
	}
	t.Cleanup(func() { _ = tg.Close() })
	var b [4]byte
	_, _ = rand.Read(b[:])
	// Ids of their own, so no two checks share a message id on a broker
	// that remembers them.
	return &target{Target: tg, t: t, next: int64(binary.BigEndian.Uint32(b[:])>>1)*1000 + 1}
}

// envelope returns the next envelope of aggregate agg, at version.
func (tg *target) envelope(agg string, version int64, eventType string) outbox.Envelope {
	id := tg.next
	tg.next++
	return outbox.Envelope{
		ID:               id,
		AggregateType:    "order",
		AggregateID:      agg,
		AggregateVersion: version,
		EventType:        eventType,
		Payload:          []byte(fmt.Sprintf(`{"order_id": %q, "n": %d}`, agg, version)),
		Headers: map[string]string{
			"traceparent":  "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
			"aggregate_id": "spoofed", // the envelope's own field must win
		},
		CreatedAt: time.Now().UTC().Truncate(time.Microsecond),
		Attempt:   1,
	}
}

// run returns aggregates aggs × versions 1..n interleaved: a1v1, a2v1, ...
func (tg *target) run(aggs []string, n int) []outbox.Envelope {
	var out []outbox.Envelope
	for v := int64(1); v <= int64(n); v++ {
		for _, a := range aggs {
			out = append(out, tg.envelope(a, v, EventStored))
		}
	}
	return out
}

func (tg *target) waitReady(timeout time.Duration) {
	tg.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := tg.Publisher.WaitReady(ctx); err != nil {
		tg.t.Fatalf("WaitReady: %v", err)
	}
}

// publish publishes msgs with a deadline of 30s and checks the number of
// results.
func (tg *target) publish(msgs []outbox.Envelope) []error {
	tg.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return tg.publishCtx(ctx, msgs)
}

func (tg *target) publishCtx(ctx context.Context, msgs []outbox.Envelope) []error {
	tg.t.Helper()
	errs := tg.Publisher.PublishBatch(ctx, msgs)
	if len(errs) != len(msgs) {
		tg.t.Fatalf("PublishBatch returned %d results for %d messages", len(errs), len(msgs))
	}
	return errs
}

func (tg *target) stored() []Message {
	tg.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ms, err := tg.Stored(ctx)
	if err != nil {
		tg.t.Fatalf("Stored: %v", err)
	}
	return ms
}

// storedIDs counts the stored messages per id.
func (tg *target) storedIDs() map[string]int {
	out := map[string]int{}
	for _, m := range tg.stored() {
		out[m.ID]++
	}
	return out
}

func (tg *target) wantAllConfirmed(what string, errs []error) {
	tg.t.Helper()
	for i, err := range errs {
		if err != nil {
			tg.t.Fatalf("%s: message %d of %d: %v, want nil", what, i, len(errs), err)
		}
	}
}

// wantNoUnstoredNil fails the test for a nil result whose message the broker
// does not hold: a confirm without the broker's word.
func (tg *target) wantNoUnstoredNil(what string, msgs []outbox.Envelope, errs []error) (confirmed int) {
	tg.t.Helper()
	ids := tg.storedIDs()
	for i, err := range errs {
		if err != nil {
			continue
		}
		confirmed++
		if ids[msgs[i].MessageID()] == 0 {
			tg.t.Errorf("%s: message %d (id %s) got nil, but the broker does not hold it", what, i, msgs[i].MessageID())
		}
	}
	return confirmed
}

// Message id, headers and payload carried.
func (k *kit) envelope(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	msgs := []outbox.Envelope{tg.envelope("o-1", 1, EventStored), tg.envelope("o-1", 2, EventStored)}
	tg.wantAllConfirmed("a batch of two", tg.publish(msgs))
	got := tg.stored()
	if len(got) != len(msgs) {
		t.Fatalf("the broker holds %d messages, want %d", len(got), len(msgs))
	}
	for i, m := range got {
		e := msgs[i]
		if m.ID != e.MessageID() {
			t.Errorf("message %d: id %q, want outbox.MessageID %q", i, m.ID, e.MessageID())
		}
		if string(m.Body) != string(e.Payload) {
			t.Errorf("message %d: body %s, want the payload %s", i, m.Body, e.Payload)
		}
		for name, want := range map[string]string{
			"aggregate_type":    e.AggregateType,
			"aggregate_id":      e.AggregateID, // over the free header of that name
			"event_type":        e.EventType,
			"aggregate_version": strconv.FormatInt(e.AggregateVersion, 10),
			"traceparent":       e.Headers["traceparent"],
		} {
			if got, ok := m.Headers[name]; !ok || got != want {
				t.Errorf("message %d: header %s = %q (present %v), want %q", i, name, got, ok, want)
			}
		}
	}
}

// nil only for what the broker holds when PublishBatch returns.
func (k *kit) durable(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	total := 0
	for range 5 {
		msgs := tg.run([]string{"o-1", "o-2", "o-3", "o-4"}, 25)
		errs := tg.publish(msgs)
		tg.wantAllConfirmed("a batch of 100", errs)
		total += tg.wantNoUnstoredNil("a batch of 100", msgs, errs)
	}
	if n := len(tg.stored()); n != total {
		t.Errorf("the broker holds %d messages after %d confirmed (none published twice)", n, total)
	}
}

// One aggregate's envelopes of a batch are stored in batch order.
func (k *kit) order(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	msgs := tg.run([]string{"o-1", "o-2", "o-3"}, 100)
	tg.wantAllConfirmed("a batch of three runs", tg.publish(msgs))
	wantInOrder(t, tg.stored(), msgs)
}

// wantInOrder checks that the stored messages of each aggregate of msgs are
// msgs' of that aggregate, in their order.
func wantInOrder(t *testing.T, stored []Message, msgs []outbox.Envelope) {
	t.Helper()
	agg := map[string]string{} // message id -> aggregate
	want := map[string][]string{}
	for _, e := range msgs {
		agg[e.MessageID()] = e.AggregateID
		want[e.AggregateID] = append(want[e.AggregateID], e.MessageID())
	}
	got := map[string][]string{}
	for _, m := range stored {
		if a, ok := agg[m.ID]; ok {
			got[a] = append(got[a], m.ID)
		}
	}
	for a, ids := range want {
		if fmt.Sprint(got[a]) != fmt.Sprint(ids) {
			t.Errorf("aggregate %s stored as %v, want %v", a, got[a], ids)
		}
	}
}

// Batches published at once: each confirmed message stored, each batch's
// aggregates in order.
func (k *kit) concurrent(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	const batches = 6
	all := make([][]outbox.Envelope, batches)
	for i := range all {
		all[i] = tg.run([]string{fmt.Sprintf("o-%d-a", i), fmt.Sprintf("o-%d-b", i)}, 40)
	}
	results := make([][]error, batches)
	var wg sync.WaitGroup
	for i := range all {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			results[i] = tg.Publisher.PublishBatch(ctx, all[i])
		})
	}
	wg.Wait()
	var msgs []outbox.Envelope
	for i := range all {
		if len(results[i]) != len(all[i]) {
			t.Fatalf("batch %d: %d results for %d messages", i, len(results[i]), len(all[i]))
		}
		tg.wantAllConfirmed(fmt.Sprintf("batch %d of %d published at once", i, batches), results[i])
		msgs = append(msgs, all[i]...)
	}
	stored := tg.stored()
	if len(stored) != len(msgs) {
		t.Errorf("the broker holds %d messages, want %d", len(stored), len(msgs))
	}
	wantInOrder(t, stored, msgs)
}

// A message published again, as a relay retries one whose confirm was lost,
// is confirmed: a broker that recognises the id says "duplicate", which
// means it holds the message. A publisher that took that for a failure
// would have the relay retry, and dead-letter, messages the broker stored.
func (k *kit) duplicate(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	first := tg.envelope("o-1", 1, EventStored)
	tg.wantAllConfirmed("the first publish", tg.publish([]outbox.Envelope{first}))
	again := first
	again.Attempt = 2
	next := tg.envelope("o-1", 2, EventStored)
	errs := tg.publish([]outbox.Envelope{again, next})
	if errs[0] != nil {
		t.Fatalf("the same message published again: %v, want nil (the broker holds it)", errs[0])
	}
	if errs[1] != nil {
		t.Fatalf("the message after the duplicate: %v, want nil", errs[1])
	}
	for range 2 {
		if errs := tg.publish([]outbox.Envelope{again}); errs[0] != nil {
			t.Fatalf("the same message published a third time: %v, want nil", errs[0])
		}
	}
	ids := tg.storedIDs()
	switch n := ids[first.MessageID()]; {
	case n == 0:
		t.Errorf("the broker does not hold the message published four times")
	case k.h.Deduplicates && n != 1:
		t.Errorf("the broker holds %d copies of one message id, want 1 (Harness.Deduplicates)", n)
	}
	if ids[next.MessageID()] != 1 {
		t.Errorf("the broker holds %d copies of the message after the duplicate, want 1", ids[next.MessageID()])
	}
}

// failing returns the event type of a message the broker fails.
func (k *kit) failing() string {
	if k.h.Refuses {
		return EventRefused
	}
	return EventUnroutable
}

// A refused message fails alone.
func (k *kit) perMessage(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	msgs := []outbox.Envelope{
		tg.envelope("o-1", 1, EventStored),
		tg.envelope("o-2", 1, k.failing()),
		tg.envelope("o-3", 1, EventStored),
		tg.envelope("o-4", 1, k.failing()),
		tg.envelope("o-5", 1, EventStored),
	}
	errs := tg.publish(msgs)
	for i, err := range errs {
		if fails := i%2 == 1; fails != (err != nil) {
			t.Errorf("message %d (%s): %v", i, msgs[i].EventType, err)
		}
	}
	tg.wantNoUnstoredNil("the mixed batch", msgs, errs)
	// A publisher that dropped its connection or channel for the failure
	// must still publish: the next batch is confirmed.
	tg.waitReady(30 * time.Second)
	after := []outbox.Envelope{tg.envelope("o-6", 1, EventStored)}
	tg.wantAllConfirmed("the batch after the failures", tg.publish(after))
	ids := tg.storedIDs()
	for i, e := range append(msgs, after...) {
		stored := ids[e.MessageID()] > 0
		if want := e.EventType == EventStored; stored != want {
			t.Errorf("message %d (%s): stored %v, want %v", i, e.EventType, stored, want)
		}
	}
}

func (k *kit) unroutable(t *testing.T, tg *target) {
	k.wantFailure(t, tg, EventUnroutable, func(err error) string {
		if !errors.Is(err, outbox.ErrUnroutable) {
			return "want an error wrapping outbox.ErrUnroutable"
		}
		return ""
	})
}

func (k *kit) refused(t *testing.T, tg *target) {
	k.wantFailure(t, tg, EventRefused, func(err error) string {
		if errors.Is(err, outbox.ErrUnroutable) {
			return "a refused message is not unroutable: the broker had somewhere to put it"
		}
		return ""
	})
}

// wantFailure publishes a message of eventType, alone and in a batch, and
// wants an error that check accepts, never ErrNotSent (the message was
// sent), and nothing stored.
func (k *kit) wantFailure(t *testing.T, tg *target, eventType string, check func(error) string) {
	tg.waitReady(30 * time.Second)
	for _, msgs := range [][]outbox.Envelope{
		{tg.envelope("o-1", 1, eventType)},
		{tg.envelope("o-2", 1, eventType), tg.envelope("o-3", 1, eventType)},
	} {
		errs := tg.publish(msgs)
		for i, err := range errs {
			switch {
			case err == nil:
				t.Errorf("%s message %d: nil, want a failure", eventType, i)
			case errors.Is(err, outbox.ErrNotSent):
				t.Errorf("%s message %d: %v: ErrNotSent says it never left the process, but the broker answered it", eventType, i, err)
			case check(err) != "":
				t.Errorf("%s message %d: %v: %s", eventType, i, err, check(err))
			}
		}
		tg.waitReady(30 * time.Second)
	}
	if n := len(tg.stored()); n != 0 {
		t.Errorf("the broker holds %d messages, want none", n)
	}
}

// After Close, WaitReady and PublishBatch fail at once.
func (k *kit) closed(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	if err := tg.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	if err := tg.Publisher.WaitReady(ctx); err == nil {
		t.Errorf("WaitReady after Close: nil, want an error")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("WaitReady after Close took %v: it must fail at once, not wait for its context", d)
	}
	msgs := []outbox.Envelope{tg.envelope("o-1", 1, EventStored)}
	errs := tg.publishCtx(ctx, msgs)
	if errs[0] == nil {
		t.Errorf("PublishBatch after Close: nil, want an error")
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("WaitReady and PublishBatch after Close took %v", d)
	}
	if n := len(tg.stored()); n != 0 {
		t.Errorf("the broker holds %d messages published after Close", n)
	}
}

// A context already ended: PublishBatch returns at once, and no nil is
// unstored.
func (k *kit) endedContext(t *testing.T, tg *target) {
	tg.waitReady(30 * time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msgs := tg.run([]string{"o-1", "o-2"}, 10)
	start := time.Now()
	errs := tg.publishCtx(ctx, msgs)
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("PublishBatch with an ended context took %v", d)
	}
	tg.wantNoUnstoredNil("a batch with an ended context", msgs, errs)
	tg.waitReady(30 * time.Second)
	tg.wantAllConfirmed("the batch after", tg.publish([]outbox.Envelope{tg.envelope("o-3", 1, EventStored)}))
}

// No reply from the broker: PublishBatch returns by its deadline, every
// message failed, none as ErrNotSent; once the broker answers again, the
// publisher publishes.
func (k *kit) deadline(t *testing.T, tg *target) {
	if tg.Link == nil {
		t.Skip("publishertest: not checked: the harness gives no Link to silence the broker (Target.Link)")
	}
	tg.waitReady(30 * time.Second)
	tg.wantAllConfirmed("before the silence", tg.publish([]outbox.Envelope{tg.envelope("o-1", 1, EventStored)}))

	tg.Link.DropReplies(true)
	const deadline = 500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	msgs := tg.run([]string{"o-2", "o-3"}, 5)
	start := time.Now()
	errs := tg.publishCtx(ctx, msgs)
	if d := time.Since(start); d > deadline+5*time.Second {
		t.Errorf("PublishBatch took %v past a %v deadline", d, deadline)
	}
	for i, err := range errs {
		switch {
		case err == nil:
			t.Errorf("message %d: nil while the broker's replies were lost: a confirm without the broker's word", i)
		case errors.Is(err, outbox.ErrNotSent):
			t.Errorf("message %d: %v: ErrNotSent, but it was sent and the broker may hold it (outcome unknown)", i, err)
		}
	}
	tg.Link.DropReplies(false)
	// The lost replies may have broken the connection's framing: the
	// publisher must find its way back.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel2()
	for {
		if err := tg.Publisher.WaitReady(ctx2); err != nil {
			t.Fatalf("WaitReady after the silence: %v", err)
		}
		after := []outbox.Envelope{tg.envelope("o-4", 1, EventStored)}
		errs := tg.publishCtx(ctx2, after)
		if errs[0] == nil {
			tg.wantNoUnstoredNil("after the silence", after, errs)
			return
		}
		if ctx2.Err() != nil {
			t.Fatalf("no message confirmed within 60s of the broker answering again: %v", errs[0])
		}
	}
}

// Connections cut during batches: no nil for a message the broker does not
// hold, and WaitReady connects again.
func (k *kit) connectionCut(t *testing.T, tg *target) {
	if tg.Link == nil {
		t.Skip("publishertest: not checked: the harness gives no Link to cut (Target.Link)")
	}
	var all []outbox.Envelope
	var allErrs []error
	// A cut before the batch, then cuts once the broker holds part of it.
	for round, held := range []int{0, 1, 50, 200} {
		tg.waitReady(60 * time.Second)
		before := len(tg.stored())
		msgs := tg.run([]string{fmt.Sprintf("o-%d-a", round), fmt.Sprintf("o-%d-b", round)}, 250)
		done := make(chan []error, 1)
		if held == 0 {
			tg.Link.CutAll()
		}
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			done <- tg.Publisher.PublishBatch(ctx, msgs)
		}()
		if held > 0 {
			for len(tg.stored()) < before+held && len(done) == 0 {
				time.Sleep(time.Millisecond)
			}
			tg.Link.CutAll()
		}
		var errs []error
		select {
		case errs = <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("PublishBatch did not return within 30s of a cut (its deadline: 10s)")
		}
		if len(errs) != len(msgs) {
			t.Fatalf("%d results for %d messages", len(errs), len(msgs))
		}
		all, allErrs = append(all, msgs...), append(allErrs, errs...)
	}
	confirmed := tg.wantNoUnstoredNil("batches cut", all, allErrs)
	t.Logf("%d of %d messages confirmed across four cuts", confirmed, len(all))
	// The last cut may land after its batch returned, and WaitReady may
	// answer before the publisher has seen it: a publish then fails with
	// ErrNotSent, as the relay expects, and the next WaitReady connects
	// again. A publisher that never connects again fails here.
	after := []outbox.Envelope{tg.envelope("o-x", 1, EventStored)}
	var errs []error
	for try := 0; try < 20; try++ {
		tg.waitReady(60 * time.Second)
		if errs = tg.publish(after); !errors.Is(errs[0], outbox.ErrNotSent) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	tg.wantAllConfirmed("after the cuts", errs)
}

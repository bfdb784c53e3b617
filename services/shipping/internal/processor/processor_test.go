package processor_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/services/shipping/internal/metrics"
	"github.com/outbox-inbox/reference/services/shipping/internal/processor"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// The verdict logic is pure; the inbox and the store are fakes here (the
// real ones are exercised end to end in internal/app).

// fakeInbox stands for the inbox's version gate: a duplicate, a version
// whose predecessor is missing (gap: the handler does not run), or the
// handler's run.
type fakeInbox struct{ duplicate, gap, alreadyApplied bool }

func (f fakeInbox) Process(ctx context.Context, msgID string, pos inbox.Position, h inbox.Handler) (inbox.Result, error) {
	if f.duplicate {
		return inbox.Duplicate, nil
	}
	if f.gap {
		return 0, &inbox.GapError{MessageID: msgID, Position: pos}
	}
	if f.alreadyApplied {
		return inbox.AlreadyApplied, nil
	}
	if err := h(ctx); err != nil {
		return 0, fmt.Errorf("%w: %w", inbox.ErrHandler, err)
	}
	return inbox.Processed, nil
}

type fakeStore struct {
	outcome shipment.Outcome
	err     error
	pingErr error
	panics  bool
}

func (f fakeStore) Apply(context.Context, string, shipment.Event) (shipment.Outcome, error) {
	if f.panics {
		panic("boom")
	}
	return f.outcome, f.err
}
func (f fakeStore) Ping(context.Context) error { return f.pingErr }

type inProgressInbox struct{}

func (inProgressInbox) Process(context.Context, string, inbox.Position, inbox.Handler) (inbox.Result, error) {
	return 0, inbox.ErrInProgress
}

func delivery(headers map[string]any) shipment.Delivery {
	h := map[string]any{"aggregate_id": "o-1", "aggregate_version": int64(1)}
	for k, v := range headers {
		h[k] = v
	}
	return shipment.Delivery{
		MessageID: "7", Type: shipment.TypeCreated, RoutingKey: shipment.TypeCreated, Headers: h,
		Body: []byte(`{"order_id":"o-1","customer_id":"c","currency":"EUR","items":[],"total":0}`),
	}
}

func counter(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

func TestVerdicts(t *testing.T) {
	for name, tc := range map[string]struct {
		inbox      processor.Inbox
		store      fakeStore
		delivery   shipment.Delivery
		action     shipment.Action
		reason     string
		header     string
		headerWant int64
		metric     func(m *metrics.Metrics) prometheus.Counter
	}{
		"applied":          {store: fakeStore{outcome: shipment.OutcomeApplied}, action: shipment.Ack, metric: func(m *metrics.Metrics) prometheus.Counter { return m.Processed }},
		"already applied":  {store: fakeStore{outcome: shipment.OutcomeAlreadyApplied}, action: shipment.Ack, metric: func(m *metrics.Metrics) prometheus.Counter { return m.Duplicates.WithLabelValues("version") }},
		"inbox duplicate":  {inbox: fakeInbox{duplicate: true}, action: shipment.Ack, metric: func(m *metrics.Metrics) prometheus.Counter { return m.Duplicates.WithLabelValues("inbox") }},
		"gate duplicate":   {inbox: fakeInbox{alreadyApplied: true}, action: shipment.Ack, metric: func(m *metrics.Metrics) prometheus.Counter { return m.Duplicates.WithLabelValues("version") }},
		"gate conflict":    {inbox: failingInbox{err: &inbox.ConflictError{MessageID: "7", HeldBy: "6"}}, action: shipment.DeadLetter, reason: "version_conflict"},
		"no message id":    {inbox: failingInbox{err: fmt.Errorf("%w: empty", inbox.ErrInvalidMessageID)}, delivery: func() shipment.Delivery { d := delivery(nil); d.MessageID = ""; return d }(), action: shipment.DeadLetter, reason: "missing_message_id"},
		"unknown type":     {delivery: func() shipment.Delivery { d := delivery(nil); d.Type = "order.paid"; return d }(), action: shipment.Ack, metric: func(m *metrics.Metrics) prometheus.Counter { return m.UnknownType }},
		"bad version":      {delivery: delivery(map[string]any{"aggregate_version": "x"}), action: shipment.DeadLetter, reason: "invalid_version"},
		"gap":              {inbox: fakeInbox{gap: true}, action: shipment.Defer, reason: "gap", header: processor.HeaderDeferrals, headerWant: 1},
		"gap, again":       {inbox: fakeInbox{gap: true}, delivery: delivery(map[string]any{processor.HeaderDeferrals: int64(4)}), action: shipment.Defer, reason: "gap", header: processor.HeaderDeferrals, headerWant: 5},
		"gap never filled": {inbox: fakeInbox{gap: true}, delivery: delivery(map[string]any{processor.HeaderDeferrals: int64(10)}), action: shipment.DeadLetter, reason: "gap_not_filled"},
		"in progress":      {inbox: inProgressInbox{}, action: shipment.Defer, reason: "in_progress", header: processor.HeaderDeferrals, headerWant: 1},
		"version conflict": {store: fakeStore{err: shipment.ErrVersionConflict}, action: shipment.DeadLetter, reason: "version_conflict"},
		"mongo down": {store: fakeStore{err: errors.New("server selection timeout"), pingErr: errors.New("down")}, action: shipment.Retry,
			metric: func(m *metrics.Metrics) prometheus.Counter { return m.MongoUnavailable }},
		"handler fails":         {store: fakeStore{err: errors.New("bug")}, action: shipment.Defer, reason: "retry", header: processor.HeaderAttempts, headerWant: 1},
		"handler keeps failing": {store: fakeStore{err: errors.New("bug")}, delivery: delivery(map[string]any{processor.HeaderAttempts: int32(2)}), action: shipment.DeadLetter, reason: "handler_failed"},
		"handler panics":        {store: fakeStore{panics: true}, action: shipment.Defer, reason: "retry", header: processor.HeaderAttempts, headerWant: 1},
	} {
		t.Run(name, func(t *testing.T) {
			m, err := metrics.New(prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			in := tc.inbox
			if in == nil {
				in = fakeInbox{}
			}
			p, err := processor.New(processor.Config{Inbox: in, Store: tc.store, Metrics: m, MaxAttempts: 3, MaxDeferrals: 10})
			if err != nil {
				t.Fatal(err)
			}
			d := tc.delivery
			if d.Headers == nil {
				d = delivery(nil)
			}
			v := p.Handle(t.Context(), d)
			if v.Action != tc.action || v.Reason != tc.reason {
				t.Fatalf("verdict %v %q (%s), want %v %q", v.Action, v.Reason, v.Detail, tc.action, tc.reason)
			}
			if v.Action == shipment.DeadLetter && v.Detail == "" {
				t.Error("dead letter without an error detail")
			}
			if tc.header != "" && v.Headers[tc.header] != tc.headerWant {
				t.Errorf("header %s = %v, want %d", tc.header, v.Headers[tc.header], tc.headerWant)
			}
			if tc.metric != nil && counter(tc.metric(m)) != 1 {
				t.Errorf("metric not counted")
			}
		})
	}
}

func TestCrashPointsAreHitInProtocolOrder(t *testing.T) {
	m, _ := metrics.New(prometheus.NewRegistry())
	for _, point := range []string{crashpoint.ShippingAfterEffectBeforeInbox, crashpoint.ShippingAfterInboxBeforeAck} {
		fired := 0
		p, err := processor.New(processor.Config{
			Inbox: fakeInbox{}, Store: fakeStore{outcome: shipment.OutcomeApplied}, Metrics: m,
			Crash: crashpoint.New(point, 1, func() { fired++ }),
		})
		if err != nil {
			t.Fatal(err)
		}
		p.Handle(t.Context(), delivery(nil))
		if fired != 1 {
			t.Errorf("%s fired %d times, want 1", point, fired)
		}
	}
}

func TestNewRequiresItsDependencies(t *testing.T) {
	if _, err := processor.New(processor.Config{}); err == nil {
		t.Fatal("New without Inbox/Store/Metrics succeeded")
	}
}

// recordingStore applies everything and remembers what it was given.
type recordingStore struct {
	applied []shipment.Event
	ids     []string
}

func (r *recordingStore) Apply(_ context.Context, msgID string, ev shipment.Event) (shipment.Outcome, error) {
	r.applied = append(r.applied, ev)
	r.ids = append(r.ids, msgID)
	return shipment.OutcomeApplied, nil
}

// idInbox is fakeInbox keeping the message ids it is given.
type idInbox struct{ ids []string }

func (in *idInbox) Process(ctx context.Context, msgID string, pos inbox.Position, h inbox.Handler) (inbox.Result, error) {
	in.ids = append(in.ids, msgID)
	return fakeInbox{}.Process(ctx, msgID, pos, h)
}

// The message id is the delivery's, handed as it is to the inbox (which
// decides whether it can be a key) and to the store: decided once, not
// copied through the decoded message and event.
func TestTheDeliverysMessageIDGoesToTheInboxAndTheStore(t *testing.T) {
	in, store := &idInbox{}, &recordingStore{}
	p, _ := newProcessor(t, in, store)
	d := delivery(nil)
	d.MessageID = "01JDQ7-é"
	if v := p.Handle(t.Context(), d); v.Action != shipment.Ack {
		t.Fatalf("verdict %v %q (%s), want an ack", v.Action, v.Reason, v.Detail)
	}
	if !slices.Equal(in.ids, []string{d.MessageID}) || !slices.Equal(store.ids, []string{d.MessageID}) {
		t.Fatalf("inbox got %q, store got %q; want %q for both", in.ids, store.ids, d.MessageID)
	}
}
func (r *recordingStore) Ping(context.Context) error { return nil }

func newProcessor(t *testing.T, in processor.Inbox, store processor.Store) (*processor.Processor, *metrics.Metrics) {
	t.Helper()
	m, err := metrics.New(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	p, err := processor.New(processor.Config{Inbox: in, Store: store, Metrics: m, MaxAttempts: 3, MaxDeferrals: 10})
	if err != nil {
		t.Fatal(err)
	}
	return p, m
}

func TestUnknownTypeIsRecordedAtItsVersion(t *testing.T) {
	store := &recordingStore{}
	p, m := newProcessor(t, fakeInbox{}, store)
	d := delivery(map[string]any{"aggregate_version": int64(2), "event_type": "order.paid"})
	d.Type, d.RoutingKey, d.Body = "order.paid", "order.paid", []byte(`{"order_id":"o-1","paid_at":"2026-11-29T22:00:30Z"}`)
	if v := p.Handle(t.Context(), d); v.Action != shipment.Ack {
		t.Fatalf("verdict %v %q (%s), want ack", v.Action, v.Reason, v.Detail)
	}
	if len(store.applied) != 1 || !store.applied[0].Ignored || store.applied[0].OrderID != "o-1" ||
		store.applied[0].Version != 2 || store.applied[0].Type != "order.paid" {
		t.Fatalf("applied %+v, want order.paid recorded as a no-op at o-1 version 2", store.applied)
	}
	if counter(m.UnknownType) != 1 {
		t.Error("unknown type not counted")
	}
}

func TestTypeComesFromTheOriginalRoutingKeyAfterTheDelayQueue(t *testing.T) {
	store := &recordingStore{}
	p, _ := newProcessor(t, fakeInbox{}, store)
	// A cancel published without type property nor event_type header, back
	// from the delay queue: its routing key is now the queue's name.
	d := delivery(map[string]any{
		"aggregate_version": int64(2), shipment.HeaderOriginalRoutingKey: shipment.TypeCancelled,
	})
	d.Type, d.RoutingKey, d.Body = "", "shipping.order-events", []byte(`{"order_id":"o-1","cancelled_at":"2026-11-29T22:01:00Z"}`)
	if v := p.Handle(t.Context(), d); v.Action != shipment.Ack {
		t.Fatalf("verdict %v %q (%s), want ack", v.Action, v.Reason, v.Detail)
	}
	if len(store.applied) != 1 || store.applied[0].Type != shipment.TypeCancelled || store.applied[0].Ignored {
		t.Fatalf("applied %+v, want the cancel", store.applied)
	}
}

// failingInbox fails by itself, before or after the handler, with an error
// that is not the handler's (a database error, a transaction that could not
// commit).
type failingInbox struct{ err error }

func (f failingInbox) Process(context.Context, string, inbox.Position, inbox.Handler) (inbox.Result, error) {
	return 0, f.err
}

func TestInboxErrorsThatAreNotTheHandlersAreNotHandlerFailures(t *testing.T) {
	for name, tc := range map[string]struct {
		err    error
		reason string
	}{
		"database error":  {errors.New("inbox: insert record 7: connection reset by peer"), "database"},
		"unauthorized":    {fmt.Errorf("inbox: read record 7: %w", errors.New("(Unauthorized) not authorized on shipping")), "database"},
		"commit unknown":  {fmt.Errorf("inbox: commit message 7: %w", errors.New("UnknownTransactionCommitResult")), "database"},
		"context expired": {fmt.Errorf("inbox: read record 7: %w", context.DeadlineExceeded), "database"},
		"transient, last error the handler's": {&inbox.TransientError{MessageID: "7", Attempts: 40,
			Err: fmt.Errorf("%w: WriteConflict", inbox.ErrHandler)}, "transient"},
	} {
		t.Run(name, func(t *testing.T) {
			p, m := newProcessor(t, failingInbox{err: tc.err}, fakeStore{outcome: shipment.OutcomeApplied})
			// Even on what would be the last attempt of a failing handler.
			d := delivery(map[string]any{"x-shipping-attempts": int64(2)})
			v := p.Handle(t.Context(), d)
			if v.Action != shipment.Defer || v.Reason != tc.reason {
				t.Fatalf("verdict %v %q (%s), want defer %q: the message is not at fault", v.Action, v.Reason, v.Detail, tc.reason)
			}
			if _, ok := v.Headers["x-shipping-attempts"]; ok {
				t.Errorf("headers %v: an inbox failure counted as a handler attempt", v.Headers)
			}
			if v.Headers["x-shipping-transient-deferrals"] != int64(1) {
				t.Errorf("headers %v: want x-shipping-transient-deferrals 1", v.Headers)
			}
			if n := counter(m.DeadLettered.WithLabelValues("handler_failed")); n != 0 {
				t.Errorf("dead-lettered %v", n)
			}
		})
	}
}

// Every message ends: deferrals are capped by count and by age, whatever
// they are for, then the message is dead-lettered with the reason.
func TestDeferralsAreCappedByCountAndByAge(t *testing.T) {
	transient := &inbox.TransientError{MessageID: "7", Attempts: 9000, Err: errors.New("(NoSuchTransaction) Transaction has been aborted")}
	unauthorized := errors.New("(Unauthorized) not authorized on shipping")
	longAgo := time.Now().Add(-31 * time.Minute).UnixMilli()
	recently := time.Now().Add(-29 * time.Minute).UnixMilli()
	for name, tc := range map[string]struct {
		inbox   processor.Inbox
		store   fakeStore
		headers map[string]any
		action  shipment.Action
		reason  string
		counter string
		want    int64
	}{
		"transient, first":            {inbox: failingInbox{err: transient}, action: shipment.Defer, reason: "transient", counter: "x-shipping-transient-deferrals", want: 1},
		"transient, 20th":             {inbox: failingInbox{err: transient}, headers: map[string]any{"x-shipping-transient-deferrals": int64(19)}, action: shipment.Defer, reason: "transient", counter: "x-shipping-transient-deferrals", want: 20},
		"transient, past the count":   {inbox: failingInbox{err: transient}, headers: map[string]any{"x-shipping-transient-deferrals": int64(20)}, action: shipment.DeadLetter, reason: "inbox_failed"},
		"database, past the count":    {inbox: failingInbox{err: unauthorized}, headers: map[string]any{"x-shipping-transient-deferrals": int32(20)}, action: shipment.DeadLetter, reason: "inbox_failed"},
		"transient, past the age":     {inbox: failingInbox{err: transient}, headers: map[string]any{"x-shipping-transient-deferrals": int64(2), "x-shipping-first-deferred-at": longAgo}, action: shipment.DeadLetter, reason: "inbox_failed"},
		"transient, within the age":   {inbox: failingInbox{err: transient}, headers: map[string]any{"x-shipping-transient-deferrals": int64(2), "x-shipping-first-deferred-at": recently}, action: shipment.Defer, reason: "transient", counter: "x-shipping-transient-deferrals", want: 3},
		"gap, past the age":           {inbox: fakeInbox{gap: true}, headers: map[string]any{"x-shipping-deferrals": int64(3), "x-shipping-first-deferred-at": longAgo}, action: shipment.DeadLetter, reason: "gap_not_filled"},
		"handler retry, past the age": {store: fakeStore{err: errors.New("bug")}, headers: map[string]any{"x-shipping-attempts": int64(1), "x-shipping-first-deferred-at": longAgo}, action: shipment.DeadLetter, reason: "handler_failed"},
	} {
		t.Run(name, func(t *testing.T) {
			m, err := metrics.New(prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			in := tc.inbox
			if in == nil {
				in = fakeInbox{}
			}
			// The defaults: 20 transient deferrals, 30 minutes.
			p, err := processor.New(processor.Config{Inbox: in, Store: tc.store, Metrics: m, MaxAttempts: 3, MaxDeferrals: 10})
			if err != nil {
				t.Fatal(err)
			}
			v := p.Handle(t.Context(), delivery(tc.headers))
			if v.Action != tc.action || v.Reason != tc.reason {
				t.Fatalf("verdict %v %q (%s), want %v %q", v.Action, v.Reason, v.Detail, tc.action, tc.reason)
			}
			if tc.action == shipment.DeadLetter {
				if v.Detail == "" {
					t.Error("dead letter without an error detail")
				}
				return
			}
			if v.Headers[tc.counter] != tc.want {
				t.Errorf("headers %v: want %s %d", v.Headers, tc.counter, tc.want)
			}
			first, ok := v.Headers["x-shipping-first-deferred-at"].(int64)
			if want, set := tc.headers["x-shipping-first-deferred-at"]; set && first != want || !ok || time.Since(time.UnixMilli(first)) < 0 {
				t.Errorf("x-shipping-first-deferred-at %v, want the first deferral's time kept", v.Headers["x-shipping-first-deferred-at"])
			}
		})
	}
}

// fakeDeadLetters is an in-memory processor.DeadLetters.
type fakeDeadLetters struct {
	recorded  []shipment.Letter
	hold      *shipment.Hold
	parked    []shipment.Parked
	recordErr error
	// afterPark, when set, runs after Park (a release beginning meanwhile).
	afterPark func(f *fakeDeadLetters)
}

func (f *fakeDeadLetters) Record(_ context.Context, l shipment.Letter) error {
	if f.recordErr != nil {
		return f.recordErr
	}
	f.recorded = append(f.recorded, l)
	return nil
}

func (f *fakeDeadLetters) Held(context.Context, string) (*shipment.Hold, error) {
	if f.hold == nil {
		return nil, nil
	}
	h := *f.hold
	return &h, nil
}

func (f *fakeDeadLetters) Park(_ context.Context, p shipment.Parked) error {
	f.parked = append(f.parked, p)
	if f.afterPark != nil {
		f.afterPark(f)
	}
	return nil
}

func (f *fakeDeadLetters) Unpark(context.Context, string, int64) (bool, error) {
	n := len(f.parked)
	f.parked = nil
	return n > 0, nil
}

func newDeadLetterProcessor(t *testing.T, store processor.Store, dl processor.DeadLetters) (*processor.Processor, *metrics.Metrics) {
	t.Helper()
	m, _ := metrics.New(prometheus.NewRegistry())
	p, err := processor.New(processor.Config{Inbox: fakeInbox{}, Store: store, Metrics: m, MaxAttempts: 3, MaxDeferrals: 10, DeadLetters: dl})
	if err != nil {
		t.Fatal(err)
	}
	return p, m
}

// newGapProcessor is newDeadLetterProcessor whose gate finds every
// message's predecessor missing.
func newGapProcessor(t *testing.T, dl processor.DeadLetters) (*processor.Processor, *metrics.Metrics) {
	t.Helper()
	m, _ := metrics.New(prometheus.NewRegistry())
	p, err := processor.New(processor.Config{Inbox: fakeInbox{gap: true}, Store: fakeStore{}, Metrics: m, MaxAttempts: 3, MaxDeferrals: 10, DeadLetters: dl})
	if err != nil {
		t.Fatal(err)
	}
	return p, m
}

func cancelDelivery(version int64, extra map[string]any) shipment.Delivery {
	h := map[string]any{"aggregate_version": version}
	for k, v := range extra {
		h[k] = v
	}
	d := delivery(h)
	d.Type, d.RoutingKey, d.Body = shipment.TypeCancelled, shipment.TypeCancelled, []byte(`{"order_id":"o-1","cancelled_at":"2026-11-29T22:01:00Z"}`)
	return d
}

func TestDeadLettersAreRecordedAndHoldTheirOrder(t *testing.T) {
	dl := &fakeDeadLetters{}
	p, _ := newDeadLetterProcessor(t, fakeStore{err: errors.New("bug")}, dl)
	d := cancelDelivery(2, map[string]any{processor.HeaderAttempts: int64(2), processor.HeaderDeferrals: int64(1)})
	if v := p.Handle(t.Context(), d); v.Action != shipment.DeadLetter || v.Reason != "handler_failed" {
		t.Fatalf("verdict %v %q", v.Action, v.Reason)
	}
	if len(dl.recorded) != 1 {
		t.Fatalf("recorded %+v, want one dead letter", dl.recorded)
	}
	l := dl.recorded[0]
	if l.OrderID != "o-1" || l.Version != 2 || !l.Holds || l.Reason != "handler_failed" || l.Message.MessageID != "7" ||
		string(l.Message.Body) != string(d.Body) || l.Message.RoutingKey != shipment.TypeCancelled {
		t.Fatalf("recorded %+v", l)
	}
	for _, h := range []string{processor.HeaderAttempts, processor.HeaderDeferrals} {
		if _, ok := l.Message.Headers[h]; ok {
			t.Errorf("kept message has %s: a replay would not start afresh", h)
		}
	}

	// A malformed payload with its order in the headers holds the order too;
	// a version conflict does not (its version is applied).
	dl.recorded = nil
	bad := cancelDelivery(2, nil)
	bad.Body = []byte(`{"order_id":`)
	p.Handle(t.Context(), bad)
	pc, _ := newDeadLetterProcessor(t, fakeStore{err: shipment.ErrVersionConflict}, dl)
	pc.Handle(t.Context(), cancelDelivery(2, nil))
	if len(dl.recorded) != 2 || !dl.recorded[0].Holds || dl.recorded[0].Reason != "malformed_payload" ||
		dl.recorded[1].Holds || dl.recorded[1].Reason != "version_conflict" {
		t.Fatalf("recorded %+v", dl.recorded)
	}
}

// A CloudEvents message without a MessageId is kept under its id attribute
// (shipment.MessageID), the id the inbox knows it by: the id a parked copy
// is told apart by, a discard records and a replay sends.
func TestAKeptCloudEventKeepsItsMessageID(t *testing.T) {
	ce := func(version int64) shipment.Delivery {
		return shipment.Delivery{ContentType: "application/json", RoutingKey: shipment.TypeCancelled, Headers: map[string]any{
			"cloudEvents_specversion": "1.0", "cloudEvents_id": fmt.Sprintf("ce-%d", version), "cloudEvents_source": "/orders",
			"cloudEvents_type": shipment.TypeCancelled, "cloudEvents_subject": "o-1", "cloudEvents_aggregateversion": version,
		}, Body: []byte(`{"order_id":"o-1","cancelled_at":"2026-11-29T22:01:00Z"}`)}
	}
	dl := &fakeDeadLetters{}
	p, _ := newDeadLetterProcessor(t, fakeStore{err: errors.New("bug")}, dl)
	d := ce(2)
	d.Headers[processor.HeaderAttempts] = int64(2)
	if v := p.Handle(t.Context(), d); v.Action != shipment.DeadLetter || len(dl.recorded) != 1 || dl.recorded[0].Message.MessageID != "ce-2" {
		t.Fatalf("verdict %v %q, recorded %+v; want a dead letter kept as ce-2", v.Action, v.Reason, dl.recorded)
	}
	dl = &fakeDeadLetters{hold: &shipment.Hold{OrderID: "o-1", Version: 2, State: shipment.StateHeld, Token: "t1"}}
	p, _ = newGapProcessor(t, dl)
	if v := p.Handle(t.Context(), ce(3)); v.Action != shipment.Ack || len(dl.parked) != 1 || dl.parked[0].Message.MessageID != "ce-3" {
		t.Fatalf("verdict %v %q, parked %+v; want it parked as ce-3", v.Action, v.Reason, dl.parked)
	}
}

func TestDeadLetterThatCannotBeRecordedKeepsTheDelivery(t *testing.T) {
	dl := &fakeDeadLetters{recordErr: errors.New("mongo down")}
	p, _ := newDeadLetterProcessor(t, fakeStore{err: errors.New("bug")}, dl)
	if v := p.Handle(t.Context(), cancelDelivery(2, map[string]any{processor.HeaderAttempts: int64(2)})); v.Action != shipment.Retry {
		t.Fatalf("verdict %v %q, want retry", v.Action, v.Reason)
	}
}

func TestLaterVersionOfAHeldOrderIsParkedAtOnce(t *testing.T) {
	dl := &fakeDeadLetters{hold: &shipment.Hold{OrderID: "o-1", Version: 2, State: shipment.StateHeld, Token: "t1"}}
	p, m := newGapProcessor(t, dl)
	if v := p.Handle(t.Context(), cancelDelivery(3, nil)); v.Action != shipment.Ack {
		t.Fatalf("verdict %v %q, want ack (parked)", v.Action, v.Reason)
	}
	if len(dl.parked) != 1 || dl.parked[0].Version != 3 || counter(m.Parked) != 1 || counter(m.Deferred.WithLabelValues("gap")) != 0 {
		t.Fatalf("parked %+v, parked count %v", dl.parked, counter(m.Parked))
	}

	// Not parked: an order without a hold, a hold of a later version, a
	// release under way.
	for name, hold := range map[string]*shipment.Hold{
		"no hold":        nil,
		"later version":  {OrderID: "o-1", Version: 5, State: shipment.StateHeld},
		"being released": {OrderID: "o-1", Version: 2, State: shipment.StateReleasing},
	} {
		dl := &fakeDeadLetters{hold: hold}
		p, _ := newGapProcessor(t, dl)
		if v := p.Handle(t.Context(), cancelDelivery(3, nil)); v.Action != shipment.Defer || v.Reason != "gap" || len(dl.parked) != 0 {
			t.Errorf("%s: verdict %v %q, parked %v; want a plain deferral", name, v.Action, v.Reason, dl.parked)
		}
	}
}

func TestParkedMessageIsTakenBackWhenAReleaseBeganMeanwhile(t *testing.T) {
	dl := &fakeDeadLetters{
		hold:      &shipment.Hold{OrderID: "o-1", Version: 2, State: shipment.StateHeld, Token: "t1"},
		afterPark: func(f *fakeDeadLetters) { f.hold.State, f.hold.Token = shipment.StateReleasing, "t2" },
	}
	p, _ := newGapProcessor(t, dl)
	if v := p.Handle(t.Context(), cancelDelivery(3, nil)); v.Action != shipment.Defer || v.Reason != "gap" {
		t.Fatalf("verdict %v %q, want the message taken back and deferred", v.Action, v.Reason)
	}
	if len(dl.parked) != 0 {
		t.Fatalf("still parked: %+v", dl.parked)
	}
}

// fakeReleases records what Applied was asked.
type fakeReleases struct {
	asked []string
	err   error
}

func (f *fakeReleases) Applied(_ context.Context, orderID string, version int64) (int, error) {
	f.asked = append(f.asked, fmt.Sprintf("%s/%d", orderID, version))
	return 0, f.err
}

// Every applied message, and every duplicate, asks to release its order at
// its version (a held version applied after all); a release that fails
// keeps the delivery.
func TestAppliedMessagesReleaseTheirOrderIfHeldAtTheirVersion(t *testing.T) {
	for name, tc := range map[string]struct {
		inbox processor.Inbox
		store fakeStore
		ask   bool
	}{
		"applied":         {store: fakeStore{outcome: shipment.OutcomeApplied}, ask: true},
		"already applied": {store: fakeStore{outcome: shipment.OutcomeAlreadyApplied}, ask: true},
		"inbox duplicate": {inbox: fakeInbox{duplicate: true}, ask: true},
		"gate duplicate":  {inbox: fakeInbox{alreadyApplied: true}, ask: true},
		"gap":             {inbox: fakeInbox{gap: true}},
		"handler fails":   {store: fakeStore{err: errors.New("bug")}},
	} {
		t.Run(name, func(t *testing.T) {
			m, _ := metrics.New(prometheus.NewRegistry())
			in := tc.inbox
			if in == nil {
				in = fakeInbox{}
			}
			rel := &fakeReleases{}
			p, err := processor.New(processor.Config{Inbox: in, Store: tc.store, Metrics: m, DeadLetters: &fakeDeadLetters{}, Releases: rel})
			if err != nil {
				t.Fatal(err)
			}
			p.Handle(t.Context(), cancelDelivery(2, nil))
			if got := fmt.Sprint(rel.asked); tc.ask && got != "[o-1/2]" || !tc.ask && len(rel.asked) != 0 {
				t.Fatalf("releases asked %s", got)
			}
			if !tc.ask {
				return
			}
			rel.err = errors.New("broker down")
			if v := p.Handle(t.Context(), cancelDelivery(2, nil)); v.Action != shipment.Retry {
				t.Fatalf("verdict %v %q with a release that failed, want retry", v.Action, v.Reason)
			}
		})
	}
}

package app_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.mongodb.org/mongo-driver/v2/bson"

	"github.com/outbox-inbox/reference/internal/crashpoint"
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
	"github.com/outbox-inbox/reference/services/shipping/internal/deadletter"
	"github.com/outbox-inbox/reference/services/shipping/internal/processor"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// brokenStore fails every Apply of version 1 of one order while broken is
// set.
type brokenStore struct {
	processor.Store
	order  string
	broken *atomic.Bool
}

func (b brokenStore) Apply(ctx context.Context, msgID string, ev shipment.Event) (shipment.Outcome, error) {
	if ev.OrderID == b.order && ev.Version == 1 && b.broken.Load() {
		return 0, errors.New("simulated bug for " + b.order)
	}
	return b.Store.Apply(ctx, msgID, ev)
}

func adminDo(t *testing.T, method, url, token string) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), method, url, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func gauge(a *app.App, name string) float64 {
	var v float64
	switch name {
	case "held":
		v = gaugeValue(a.Metrics().HeldOrders)
	case "parked":
		v = gaugeValue(a.Metrics().ParkedMessages)
	}
	return v
}

func TestDeadLetterParksItsOrderUntilReplayedWhileOthersFlow(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var broken atomic.Bool
	broken.Store(true)
	a := e.start(app.Config{
		MaxAttempts: 2, AdminToken: "s3cret", DeadLetterStatsInterval: 50 * time.Millisecond,
		WrapStore: func(s processor.Store) processor.Store { return brokenStore{s, "held-1", &broken} },
	})
	base := "http://" + a.HTTPAddr()

	e.pub.publish(created("1601", "held-1"))
	var dead []amqp.Delivery
	waitFor(t, 30*time.Second, "the create dead-lettered", func() bool {
		dead = append(dead, e.deadLetters(a.Topology().DeadLetterQueue)...)
		return len(dead) > 0
	})
	// Later versions of the held order are parked at once: no trip through
	// the delay queue waiting for version 1.
	e.pub.publish(cancelled("1602", "held-1"))
	waitFor(t, 30*time.Second, "the cancel parked", func() bool { return value(a.Metrics().Parked) == 1 })
	if g := deferredGap(a); g != 0 {
		t.Errorf("the parked cancel was deferred %v times for a gap, want 0", g)
	}
	// Other orders flow.
	e.pub.publish(created("1611", "free-1"))
	e.pub.publish(cancelled("1612", "free-1"))
	wantEvents(t, e.waitShipment("free-1", 2), "1611", "1612")
	waitFor(t, 10*time.Second, "the gauges", func() bool { return gauge(a, "held") == 1 && gauge(a, "parked") == 1 })

	if status, _ := adminDo(t, http.MethodGet, base+"/admin/dead-letters", ""); status != http.StatusUnauthorized {
		t.Fatalf("list without a token: %d, want 401", status)
	}
	if status, _ := adminDo(t, http.MethodGet, base+"/admin/dead-letters", "wrong"); status != http.StatusUnauthorized {
		t.Fatalf("list with a wrong token: %d, want 401", status)
	}
	status, body := adminDo(t, http.MethodGet, base+"/admin/dead-letters", "s3cret")
	var list struct {
		DeadLetters []struct {
			OrderID string `json:"order_id"`
			Version int64  `json:"version"`
			Reason  string `json:"reason"`
			Message struct {
				MessageID string `json:"message_id"`
			} `json:"message"`
		} `json:"dead_letters"`
		HeldOrders []struct {
			OrderID     string `json:"order_id"`
			DeadVersion int64  `json:"dead_version"`
			Parked      int    `json:"parked"`
		} `json:"held_orders"`
	}
	if err := json.Unmarshal([]byte(body), &list); status != http.StatusOK || err != nil {
		t.Fatalf("list: %d %s (%v)", status, body, err)
	}
	if len(list.DeadLetters) != 1 || list.DeadLetters[0].Message.MessageID != "1601" || list.DeadLetters[0].Reason != "handler_failed" ||
		len(list.HeldOrders) != 1 || list.HeldOrders[0].OrderID != "held-1" || list.HeldOrders[0].DeadVersion != 1 || list.HeldOrders[0].Parked != 1 {
		t.Fatalf("list: %s", body)
	}
	if vs := e.order.versions("held-1"); len(vs) != 0 {
		t.Fatalf("versions %v of the held order applied", vs)
	}

	broken.Store(false) // the fix is deployed
	if status, body := adminDo(t, http.MethodPost, base+"/admin/dead-letters/held-1/7/replay", "s3cret"); status != http.StatusNotFound {
		t.Fatalf("replay of no dead letter: %d %s, want 404", status, body)
	}
	status, body = adminDo(t, http.MethodPost, base+"/admin/dead-letters/held-1/1/replay", "s3cret")
	if status != http.StatusOK || !strings.Contains(body, `"released":1`) {
		t.Fatalf("replay: %d %s", status, body)
	}
	s := e.waitShipment("held-1", 2)
	wantEvents(t, s, "1601", "1602")
	if vs := e.order.waitVersions(t, "held-1", 2); fmt.Sprint(vs) != "[1 2]" {
		t.Fatalf("application order %v, want [1 2]", vs)
	}
	e.waitDrained(a)
	waitFor(t, 10*time.Second, "the gauges back to 0", func() bool { return gauge(a, "held") == 0 && gauge(a, "parked") == 0 })
	if _, body := adminDo(t, http.MethodGet, base+"/admin/dead-letters", "s3cret"); !strings.Contains(body, `"dead_letters":[]`) || !strings.Contains(body, `"held_orders":[]`) {
		t.Fatalf("after the replay: %s", body)
	}
}

func TestDiscardedDeadLetterReleasesTheRestOfItsOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{AdminToken: "s3cret"})
	base := "http://" + a.HTTPAddr()

	e.pub.publish(created("1701", "disc-1"))
	e.waitShipment("disc-1", 1)
	bad := cancelled("1702", "disc-1")
	bad.Body = []byte(`{"order_id": "disc-1",`) // version 2, malformed
	e.pub.publish(bad)
	waitFor(t, 30*time.Second, "the malformed version dead-lettered", func() bool {
		return value(a.Metrics().DeadLettered.WithLabelValues("malformed_payload")) == 1
	})
	next := cancelled("1703", "disc-1")
	next.Version = int64(3)
	e.pub.publish(next)
	waitFor(t, 30*time.Second, "version 3 parked", func() bool { return value(a.Metrics().Parked) == 1 })

	status, body := adminDo(t, http.MethodPost, base+"/admin/dead-letters/disc-1/2/discard", "s3cret")
	if status != http.StatusOK || !strings.Contains(body, `"released":1`) {
		t.Fatalf("discard: %d %s", status, body)
	}
	s := e.waitShipment("disc-1", 3)
	wantEvents(t, s, "1701", "1702", "1703")
	if s.Status != shipment.StatusCancelled || !s.Events[1].Discarded || s.Events[2].Discarded {
		t.Fatalf("shipment %+v: want cancelled by version 3, version 2 discarded", s)
	}
	if vs := e.order.waitVersions(t, "disc-1", 2); fmt.Sprint(vs) != "[1 3]" {
		t.Fatalf("application order %v, want [1 3] (2 discarded)", vs)
	}
}

// holdBehindDeadLetter records, in e's database, the create of orderID
// (message createID) as a dead letter holding its order, and parks its
// cancel (cancelID) behind it.
func holdBehindDeadLetter(t *testing.T, e *env, orderID, createID, cancelID string) *deadletter.Store {
	t.Helper()
	store, err := deadletter.NewStore(e.db)
	if err != nil {
		t.Fatal(err)
	}
	kept := func(ev event) shipment.KeptMessage {
		return shipment.KeptMessage{MessageID: ev.MessageID, Type: ev.Type, ContentType: "application/json", RoutingKey: ev.Type,
			Headers: map[string]any{"aggregate_type": "order", "aggregate_id": ev.OrderID, "event_type": ev.Type, "aggregate_version": ev.Version},
			Body:    ev.Body}
	}
	now := time.Now().UTC()
	if err := store.Record(t.Context(), shipment.Letter{OrderID: orderID, Version: 1, EventType: shipment.TypeCreated,
		Reason: "handler_failed", Holds: true, DeadLetteredAt: now, Message: kept(created(createID, orderID))}); err != nil {
		t.Fatal(err)
	}
	if err := store.Park(t.Context(), shipment.Parked{OrderID: orderID, Version: 2, ParkedAt: now, Message: kept(cancelled(cancelID, orderID))}); err != nil {
		t.Fatal(err)
	}
	return store
}

func TestServiceFinishesAReleaseACrashInterruptedAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// What a service killed in the middle of a replay leaves: the order's
	// hold marked releasing, the dead letter and a parked version still there.
	store := holdBehindDeadLetter(t, e, "res-1", "1801", "1802")
	if _, err := e.db.Collection(deadletter.HoldsCollection).UpdateOne(t.Context(), bson.D{{Key: "_id", Value: "res-1"}},
		bson.D{{Key: "$set", Value: bson.D{{Key: "state", Value: shipment.StateReleasing}, {Key: "action", Value: "replay"}}}}); err != nil {
		t.Fatal(err)
	}

	a := e.start(app.Config{})
	s := e.waitShipment("res-1", 2)
	wantEvents(t, s, "1801", "1802")
	e.waitDrained(a)
	letters, holds, err := store.List(t.Context())
	if err != nil || len(letters) != 0 || len(holds) != 0 {
		t.Fatalf("after the restart: dead letters %+v, holds %+v, %v; want the release finished", letters, holds, err)
	}
}

// The service's Crash arms the releases' crash point too: an operator's
// replay hits it after re-publishing the parked version.
func TestServiceCrashArmsTheReleasesCrashPoint(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	holdBehindDeadLetter(t, e, "rel-1", "1851", "1852")
	fired := make(chan struct{})
	a := e.start(app.Config{AdminToken: "s3cret",
		Crash: crashpoint.New(crashpoint.ShippingReleaseAfterPublish, 1, func() { close(fired) })})
	if code, body := adminDo(t, http.MethodPost, "http://"+a.HTTPAddr()+"/admin/dead-letters/rel-1/1/replay", "s3cret"); code != http.StatusOK {
		t.Fatalf("replay: %d %s", code, body)
	}
	select {
	case <-fired:
	case <-time.After(30 * time.Second):
		t.Fatal("the release's crash point was not hit")
	}
	wantEvents(t, e.waitShipment("rel-1", 2), "1851", "1852")
	e.waitDrained(a)
}

// A dead-lettered version that applies after all (the relay published it
// again, its handler's trouble over) releases what its order held: the
// versions parked behind it follow, in order, and no dead letter nor hold
// is left for an operator to replay.
func TestDeadLetteredVersionAppliedByAnotherCopyReleasesItsOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var broken atomic.Bool
	broken.Store(true)
	a := e.start(app.Config{
		MaxAttempts: 2, AdminToken: "s3cret", DeadLetterStatsInterval: 50 * time.Millisecond,
		WrapStore: func(s processor.Store) processor.Store { return brokenStore{s, "again-1", &broken} },
	})
	e.pub.publish(created("1901", "again-1"))
	waitFor(t, 30*time.Second, "the create dead-lettered", func() bool {
		return value(a.Metrics().DeadLettered.WithLabelValues("handler_failed")) == 1
	})
	e.pub.publish(cancelled("1902", "again-1"))
	waitFor(t, 30*time.Second, "the cancel parked", func() bool { return value(a.Metrics().Parked) == 1 })

	broken.Store(false)
	e.pub.publish(created("1901", "again-1")) // the relay's second copy
	s := e.waitShipment("again-1", 2)
	wantEvents(t, s, "1901", "1902")
	if vs := e.order.waitVersions(t, "again-1", 2); fmt.Sprint(vs) != "[1 2]" {
		t.Fatalf("application order %v, want [1 2]", vs)
	}
	waitFor(t, 10*time.Second, "the gauges back to 0", func() bool { return gauge(a, "held") == 0 && gauge(a, "parked") == 0 })
	if _, body := adminDo(t, http.MethodGet, "http://"+a.HTTPAddr()+"/admin/dead-letters", "s3cret"); !strings.Contains(body, `"dead_letters":[]`) || !strings.Contains(body, `"held_orders":[]`) {
		t.Fatalf("after the second copy applied: %s; want no dead letter and no held order left", body)
	}
	e.waitDrained(a)
}

// The service creates the dead-letter collections' indexes at start.
func TestServiceCreatesTheDeadLetterIndexesAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.start(app.Config{DeadLetterStatsInterval: 50 * time.Millisecond})
	indexes := func(coll string) []string {
		cur, err := e.db.Collection(coll).Indexes().List(t.Context())
		if err != nil {
			return nil
		}
		var specs []struct {
			Key bson.D `bson:"key"`
		}
		if err := cur.All(t.Context(), &specs); err != nil {
			return nil
		}
		var out []string
		for _, s := range specs {
			var keys []string
			for _, k := range s.Key {
				keys = append(keys, k.Key)
			}
			out = append(out, strings.Join(keys, ","))
		}
		return out
	}
	want := map[string][]string{
		deadletter.LettersCollection: {"order_id,holds,version", "dead_lettered_at"},
		deadletter.ParkedCollection:  {"order_id,version", "order_id,parked_at", "parked_at"},
		deadletter.HoldsCollection:   {"state"},
	}
	waitFor(t, 30*time.Second, "the dead-letter indexes", func() bool {
		for coll, keys := range want {
			have := indexes(coll)
			for _, k := range keys {
				if !slices.Contains(have, k) {
					return false
				}
			}
		}
		return true
	})
}

// A version dead-lettered because its predecessor never came
// (gap_not_filled) holds its order; when the predecessor applies later (the
// relay was slow, or the predecessor was itself released), the gap is filled:
// the dead letter is replayed with no operator and the order released.
func TestGapDeadLetterIsReplayedWhenItsPredecessorApplies(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{MaxDeferrals: 1, AdminToken: "s3cret", DeadLetterStatsInterval: 50 * time.Millisecond})

	e.pub.publish(cancelled("2102", "gap-1")) // version 2, before version 1
	waitFor(t, 30*time.Second, "the cancel dead-lettered for its gap", func() bool {
		return value(a.Metrics().DeadLettered.WithLabelValues(string(shipment.ReasonGapNotFilled))) == 1
	})
	waitFor(t, 10*time.Second, "the order held", func() bool { return gauge(a, "held") == 1 })

	e.pub.publish(created("2101", "gap-1")) // the predecessor, late
	s := e.waitShipment("gap-1", 2)
	wantEvents(t, s, "2101", "2102")
	if vs := e.order.waitVersions(t, "gap-1", 2); fmt.Sprint(vs) != "[1 2]" {
		t.Fatalf("application order %v, want [1 2]", vs)
	}
	waitFor(t, 10*time.Second, "the gauges back to 0", func() bool { return gauge(a, "held") == 0 && gauge(a, "parked") == 0 })
	if _, body := adminDo(t, http.MethodGet, "http://"+a.HTTPAddr()+"/admin/dead-letters", "s3cret"); !strings.Contains(body, `"dead_letters":[]`) || !strings.Contains(body, `"held_orders":[]`) {
		t.Fatalf("after the predecessor applied: %s; want no dead letter and no held order left", body)
	}
	e.waitDrained(a)
}

// An event created longer ago than the inbox keeps its records (its message
// id carries its creation time) may have been applied and forgotten: it is
// dead-lettered as beyond_dedup_horizon instead of applied, and holds its
// order. A recent event applies as usual.
func TestAnEventOlderThanTheInboxRetentionIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := e.start(app.Config{InboxRetention: time.Hour, DeadLetterStatsInterval: 50 * time.Millisecond})

	old := outbox.MessageID(2201, time.Now().Add(-2*time.Hour))
	e.pub.publish(created(old, "old-1"))
	waitFor(t, 30*time.Second, "the old event dead-lettered", func() bool {
		return value(a.Metrics().DeadLettered.WithLabelValues(string(shipment.ReasonBeyondHorizon))) == 1
	})
	if _, ok := e.shipment("old-1"); ok {
		t.Fatal("an event older than the inbox's retention was applied")
	}
	recent := outbox.MessageID(2202, time.Now())
	e.pub.publish(created(recent, "new-1"))
	wantEvents(t, e.waitShipment("new-1", 1), recent)
	e.waitDrained(a)
}

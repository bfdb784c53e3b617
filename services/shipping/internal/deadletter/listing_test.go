package deadletter

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"

	"github.com/outbox-inbox/reference/internal/mongolocal/mongotest"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

// What an operator's listing, the metrics and a start cost does not grow
// with the number of held orders, nor with the size of the kept messages:
// List reads each collection once, and no reply carries a message body
// (BenchmarkList measures it with 10,000 parked messages).
func TestListingReadsEachCollectionOnceWithoutBodies(t *testing.T) {
	t.Parallel()
	db, cmds := mongotest.Watched(t)
	s, err := NewStore(db)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	const orders, perOrder = 20, 10
	start := fillParked(t, s, orders, perOrder)
	if err := s.EnsureIndexes(ctx); err != nil {
		t.Fatal(err)
	}

	noBodies := func(what string, since int) {
		t.Helper()
		for _, r := range cmds.RepliesSince(since, "find", "getMore", "aggregate") {
			if bytes.Contains(r, []byte("PARKED-BODY")) || bytes.Contains(r, []byte("LETTER-BODY")) {
				t.Fatalf("%s: a reply carries message bodies (%d bytes)", what, len(r))
			}
		}
	}
	reads := func(since int) map[string]int {
		out := map[string]int{}
		for _, e := range cmds.Since(since, "find", "aggregate", "count") {
			coll, _ := e.Command.Lookup(e.CommandName).StringValueOK()
			out[e.CommandName+" "+coll]++
		}
		return out
	}

	n := cmds.Len()
	ls, hs, err := s.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ls) != orders || len(hs) != orders {
		t.Fatalf("List: %d dead letters, %d holds; want %d each", len(ls), len(hs), orders)
	}
	for _, h := range hs {
		if h.Parked != perOrder || h.OldestParkedAt == nil || !h.OldestParkedAt.Equal(start.Add(2*time.Second)) {
			t.Fatalf("hold %s: %d parked, oldest %v; want %d, %v", h.OrderID, h.Parked, h.OldestParkedAt, perOrder, start.Add(2*time.Second))
		}
	}
	if got := reads(n); len(got) != 3 || got["find "+LettersCollection] != 1 || got["find "+HoldsCollection] != 1 || got["find "+ParkedCollection] != 1 {
		t.Fatalf("List read %v; want one find on each collection", got)
	}
	noBodies("List", n)

	n = cmds.Len()
	st, err := s.Stats(ctx, start.Add(time.Minute))
	if err != nil || st.HeldOrders != orders || st.DeadLetters != orders || st.Parked != orders*perOrder || st.OldestParkedAge != time.Minute-2*time.Second {
		t.Fatalf("Stats: %+v, %v", st, err)
	}
	noBodies("Stats", n)

	n = cmds.Len()
	releasing, err := s.releasing(ctx)
	if err != nil || len(releasing) != 1 || releasing[0].OrderID != "o-7" {
		t.Fatalf("releasing: %+v, %v; want o-7 alone", releasing, err)
	}
	if got := reads(n); len(got) != 1 || got["find "+HoldsCollection] != 1 {
		t.Fatalf("finding the releases to resume read %v; want one find on %s", got, HoldsCollection)
	}
	noBodies("releasing", n)
}

var (
	letterBody = bytes.Repeat([]byte("LETTER-BODY "), 40)
	parkedBody = bytes.Repeat([]byte("PARKED-BODY "), 40)
)

// fillParked holds orders orders (o-0, o-1, ...; o-7 with its release
// interrupted) behind a dead letter at version 1 each, with perOrder
// messages parked behind each, parked a second apart from the returned
// time on.
func fillParked(tb testing.TB, s *Store, orders, perOrder int) time.Time {
	tb.Helper()
	start := time.Now().UTC().Truncate(time.Millisecond)
	var letters, holds, parked []any
	for o := range orders {
		id := fmt.Sprintf("o-%d", o)
		letters = append(letters, letterDocOf(shipment.Letter{OrderID: id, Version: 1, Reason: "handler_failed", Holds: true,
			DeadLetteredAt: start, Message: shipment.KeptMessage{MessageID: id + "-1", RoutingKey: "order.created", Body: letterBody, Headers: map[string]any{"k": "v"}}}))
		state := shipment.StateHeld
		if o == 7 {
			state = shipment.StateReleasing
		}
		holds = append(holds, holdDocOf(shipment.Hold{OrderID: id, Version: 1, State: state, Action: "replay", Token: "t", Since: start}))
		for v := int64(2); v < 2+int64(perOrder); v++ {
			parked = append(parked, parkedDoc{ID: key(id, v), OrderID: id, Version: v,
				ParkedAt: start.Add(time.Duration(v) * time.Second), Message: messageDoc{MessageID: fmt.Sprintf("%s-%d", id, v), Body: parkedBody}})
		}
	}
	for _, w := range []struct {
		coll *mongo.Collection
		docs []any
	}{{s.letters, letters}, {s.holds, holds}, {s.parked, parked}} {
		if _, err := w.coll.InsertMany(context.Background(), w.docs); err != nil {
			tb.Fatal(err)
		}
	}
	return start
}

// BenchmarkList lists 10,000 parked messages held behind 10, 100 and 1,000
// orders: its cost does not grow with the number of held orders (it grew
// with their product, each order's parked messages read with their bodies).
func BenchmarkList(b *testing.B) {
	const parked = 10_000
	for _, orders := range []int{10, 100, 1000} {
		b.Run(fmt.Sprintf("orders=%d", orders), func(b *testing.B) {
			s, err := NewStore(mongotest.Database(b))
			if err != nil {
				b.Fatal(err)
			}
			fillParked(b, s, orders, parked/orders)
			if err := s.EnsureIndexes(b.Context()); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for range b.N {
				if _, holds, err := s.List(b.Context()); err != nil || len(holds) != orders {
					b.Fatalf("List: %d holds, %v", len(holds), err)
				}
			}
		})
	}
}

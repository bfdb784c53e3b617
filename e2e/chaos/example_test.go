package chaos_test

import (
	"fmt"

	"github.com/outbox-inbox/reference/e2e/chaos"
)

// A committed order whose event shipping applied twice, and a cancel applied
// before its create.
func ExampleCheck() {
	h := chaos.History{Ops: []chaos.Op{
		{Kind: chaos.OpCreate, Key: "k1", OrderID: "o1", Outcome: chaos.OutcomeOK, Status: 201},
	}}
	s := chaos.FinalState{
		Orders: []chaos.CommittedOrder{{ID: "o1", Key: "k1", Status: chaos.StatusCancelled, Version: 2}},
		Events: []chaos.CommittedEvent{
			{MessageID: "1", OrderID: "o1", Version: 1, Type: chaos.EventCreated},
			{MessageID: "2", OrderID: "o1", Version: 2, Type: chaos.EventCancelled},
		},
		Shipments: []chaos.Shipment{{OrderID: "o1", Events: []chaos.AppliedEvent{
			{MessageID: "2", EventType: chaos.EventCancelled, Version: 2},
			{MessageID: "1", EventType: chaos.EventCreated, Version: 1},
			{MessageID: "1", EventType: chaos.EventCreated, Version: 1},
		}}},
		DuplicatesDelivered: 1,
	}
	r := chaos.Check(h, s, chaos.RunInfo{Seed: 1, Drained: true, DrainBudget: 1})
	fmt.Println("ok:", r.OK, "lost:", r.Lost, "duplicate_effects:", r.DuplicateEffects, "out_of_order:", r.OutOfOrder)
	for _, v := range r.Violations {
		fmt.Println(v)
	}
	// Output:
	// ok: false lost: 0 duplicate_effects: 1 out_of_order: 1
	// I2 duplicate_effect order=o1 message=1: v1 order.created was applied 2 times
	// I3 out_of_order order=o1: applied v2 order.cancelled, v1 order.created; want versions 1, 2, ... starting with order.created
}

// A plan covers every fault kind of the profile at least once, at seeded
// random times.
func ExampleNewPlan() {
	p := chaos.ShortProfile()
	plan, err := chaos.NewPlan(42, p, chaos.Topology{Relays: 2, Consumers: 2})
	if err != nil {
		fmt.Println(err)
		return
	}
	kinds := map[chaos.FaultKind]bool{}
	for _, s := range plan {
		kinds[s.Kind] = true
	}
	fmt.Println(len(plan) == p.Faults, len(kinds) == len(p.Kinds))
	// Output:
	// true true
}

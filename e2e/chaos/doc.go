// Package chaos holds the pure parts of the end-to-end chaos suite: the
// record of what a run did (History, Recorder), the fault plan drawn from a
// seed (Profile, NewPlan), the workload client that drives the orders API
// (Workload), and the checker that turns a history and a final state into a
// Report on invariants I1-I6 (docs/guarantees.md).
//
// The checker is a function of plain data: the operations the clients saw
// (ok, failed, unknown outcome), the faults and poison messages injected, the
// orders and outbox rows committed, the shipments with the events applied to
// them in order, the dead-letter queue's contents and the duplicates the
// consumers absorbed. It reports:
//
//   - I1 acknowledged_not_committed, failed_but_committed, and orders whose
//     outbox rows do not match their state (the write and its event must
//     commit together);
//   - I2 lost (a committed event with no effect, or dead-lettered by the
//     relay), duplicate_effects (an event applied twice), unknown effects;
//   - I3 out_of_order (per order, versions applied 1, 2, ... from
//     order.created);
//   - I4 duplicates_delivered must be positive: the run exercised the inbox;
//   - I5 drain time within the profile's budget;
//   - I6 dead letters exactly the injected poison (matched by PoisonHeader,
//     since one kind has no MessageId), each with a reason, and never the
//     unknown event type. Extra copies of one poison are tolerated and
//     counted: dead-lettering is at-least-once.
//
// An operation with an unknown outcome may or may not have been committed:
// both are correct, which is why the workload sends the Idempotency-Key as
// the customer id, letting the checker tie a committed order to its request.
//
// Nothing here talks to a service except Workload, which only needs an HTTP
// endpoint: its tests use an httptest fake that fails on purpose.
package chaos

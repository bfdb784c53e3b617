// Package outboxwal is a relay for package outbox that reads the outbox's
// inserts from PostgreSQL's write-ahead log (logical replication, pgoutput)
// instead of polling the table, and publishes them through the same
// outbox.Publisher. Writers do not change: outbox.Enqueue and Writer.Queue.
//
// # Why
//
// The polling relay spends about 100 µs of PostgreSQL work per event: the
// claim's update, the move to outbox_published, the unblock of the
// aggregate's next event. The committed inserts are already in the WAL, in
// commit order: this relay reads them from a replication slot, keeps the
// per-event state in memory, and writes to the outbox table only to delete
// the rows the broker confirmed, many thousands per statement. See
// docs/benchmarks.md for the figures on this repository's machine.
//
// # Use
//
//	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: amqpURL, Exchange: "orders.events"})
//	...
//	relay, err := outboxwal.NewRelay(pool, pub, outboxwal.Config{Slot: "orders_outbox", Publication: "orders_outbox"})
//	...
//	err = relay.Run(ctx) // until ctx is cancelled
//
// Run needs package outbox's schema (outbox.Migrate:
// the hand-over column and its indexes are there, built concurrently; Run
// runs no DDL on the outbox table). It creates what is the WAL relay's own
// when missing: the publication (FOR TABLE outbox WITH (publish = 'insert')),
// the slot, and the table outbox_wal_slots (Schema: one row per slot, see
// Failover). Prepare does the same from a deployment step. Creating the slot
// waits for every transaction then running on the server, in any database,
// to end (at most 2 minutes, with a warning after 10 s). Start as many
// relays as you like on one slot: one streams, the others wait (looking at
// the slot through the pool, without a WAL sender) and take over within
// TakeoverInterval of the slot becoming free (see Failover). Never run the
// polling relay (outbox.Relay) on the same outbox at the same time: both
// would publish every event. To go back to polling, stop the WAL relays, run
// the polling relay, and Drop the slot.
//
// Choose it when PostgreSQL's CPU or the end-to-end latency is what limits
// the polling relay, and the server allows logical replication to a role
// the relay can use; keep the polling relay behind a connection pooler, with
// no special privileges, or when WAL retention on the server's disk is a
// risk nobody watches.
//
// # Guarantees
//
// The same as the polling relay's (see package outbox):
//
//   - At least once. The slot is acknowledged (the standby status update's
//     flush position) only up to the end of the last transaction below which
//     every event is resolved: confirmed by the broker and its row deleted (or
//     moved to outbox_published with Config.Archive), or handed over to
//     polling (below). After a crash, a lost replication connection, a
//     PostgreSQL restart or a takeover, the stream resumes from that position:
//     events after it are published again (duplicates with the same message
//     id, which consumers deduplicate). Events decoded from before the
//     session began are first looked up in the outbox: those whose rows are
//     gone were confirmed and are not published again.
//   - Order per aggregate, as package outbox states it: the first copies of
//     an aggregate's events reach the broker in version order unless a
//     publish fails; the events of a run behind a failed one go out again
//     after it, so their last copies arrive after its; a copy sent again (a
//     lost confirm, a lease that ended mid-publish) can arrive after later
//     events. Every message carries its aggregate_version (1, 2, ... without
//     gaps): a consumer that applies version v only after v-1, and drops what
//     it applied, sees each aggregate in order. Writers of one aggregate are
//     serialised by Enqueue until they commit, so the stream gives each
//     aggregate's events in version order. An event is handed to the
//     publisher only once the previous event of its aggregate was confirmed,
//     or behind it in the same batch: a batch takes aggregates' heads, each
//     followed by a run of its next decoded events, sent in version order on
//     one channel, and an event of a run counts as confirmed only if every
//     earlier one of the run was (the others go to polling with the failed
//     one). Many batches are in flight (Workers x BatchSize messages,
//     confirms pipelined by the publisher).
//   - Failures leave the stream. An event the broker refuses or returns,
//     or that gets no verdict within PublishTimeout, is handed over to
//     polling at once, with every later event of its aggregate: the polling
//     relay this relay runs (Config.Poll) retries it with its backoff,
//     dead-letters it after Poll.MaxAttempts attempts in all (exactly as
//     the polling relay does: dead_lettered_at, attempts, last_error,
//     visible to outboxadmin.Admin), and publishes the aggregate's later events
//     after it, in order. The stream and the slot move on meanwhile: a
//     failing aggregate never keeps other aggregates' events or the
//     server's WAL waiting.
//   - A relay that stops (a crash, a kill, a lost connection) counts. Before
//     each batch, the relay records in outbox_wal_slots the commit position
//     it has dispatched up to. The relay that resumes treats the events at or
//     below that position as possibly in flight at the stop: before each of
//     their attempts, and before every retry of any event, it records the
//     attempt in the row (attempts + 1, in_flight), and takes it back when
//     the broker confirms it. An event already in flight at an earlier stop
//     (in_flight set when a relay resumes) is published alone, with nothing
//     else of the stream in flight, so that if it is what kills relays, no
//     other event is charged. (The polling relay this relay runs for
//     handed-over rows keeps the same rule among its own rows, but the two
//     do not wait for each other: a row of one that kills the process while
//     the other has recorded attempts in flight charges those one attempt.)
//     Once an event's attempts without an outcome reach MaxAttempts
//     it is dead-lettered with the reason "no outcome after attempt N of M:
//     the relay stopped ...", as the polling relay's lease does it. An
//     event's first attempt is not recorded (that is the fast path, and what
//     keeps PostgreSQL out of it): an event the broker confirmed whose row a
//     stopped relay had not swept yet is counted one attempt too many.
//   - Hand-overs hold back their aggregate only. Every later event of an
//     aggregate handed over, already decoded or decoded later, is parked:
//     left in the outbox table, its last_error set to say why, blocked
//     behind the earlier row as Enqueue wrote it, marked handed_over. A polling
//     relay that only claims handed-over rows, run
//     by this relay, publishes them with the polling relay's protocol, in
//     order, once the earlier row is published, or, for a dead letter, once
//     an operator retries (Admin.Retry) or discards (Admin.Discard) it. When
//     no handed-over row of the aggregate is left, the relay publishes its
//     next events from the stream again. Other aggregates flow throughout.
//   - Admin.Status is right: the rows of published events leave the outbox
//     within SweepInterval, and the table holds the backlog, the dead letters
//     and the parked rows only.
//   - Nothing goes out before its transaction is visible. The stream
//     delivers a transaction once its commit record is flushed: under
//     synchronous replication the commit then still waits for the standby,
//     invisible to other sessions and unacknowledged to its client, and a
//     failover at that moment undoes it. The relay publishes, sweeps, hands
//     over or looks up an event only once a snapshot shows its transaction
//     committed (one pg_current_snapshot() per batch), so no consumer hears
//     of a change the database may still lose, and no row is taken for gone
//     because a statement could not see it yet. The relay's own writes
//     (dispatched position, sweeps) wait for the standby too unless its pool
//     sets synchronous_commit = local, which is safe: what they record is
//     redone after a failover (see Failover).
//
// When the slot is created, the rows already in the outbox are not in its
// stream: Run hands them over to polling (read in the snapshot the slot
// exports), so switching from the polling relay loses nothing, and those rows
// go out before the later events of their aggregates. However large that
// backlog, the hand-over runs in bounded steps, each a short transaction of
// its own: the rows are listed in chunks (their aggregates pinned: a later
// event of one of them is parked behind them, never published first), then
// the relay streams, publishing the events of other aggregates at once, while
// the listed rows are marked for polling a chunk at a time beside the stream.
// Until the last chunk is marked the slot is not recorded as ready, and a
// relay that starts again lists and marks anew; what was marked stays with
// polling. The same steps hand the outbox over after a switch of server (see
// Failover).
//
// The relay reads its own publication only: one that also publishes other
// tables (or all of them) is refused at start with a clear error, changes of
// a table added to it later are skipped, and a row the relay cannot decode
// (a header that is not a string, inserted without Enqueue) is
// dead-lettered by id, its aggregate held back. A session that fails
// without having made progress is retried with a growing backoff (up to
// 5s): every session is a new WAL sender reading again from the slot's
// restart point.
//
// # Table size
//
// The rows of confirmed events are deleted (or archived) every SweepInterval
// in one transaction per up to 10,000 rows (the delete, then the unblock of
// each aggregate's next event, as the polling relay's mark does, so that a
// polling relay can claim it later), skipping (and retrying a moment later) a
// row the writer of its aggregate's next event holds. The slot is
// acknowledged past an event only after its row is gone, so a row is never
// left behind by a crash. The schema's autovacuum settings for outbox (a
// fixed threshold of 5,000 changes) keep dead tuples in check; on a server
// where autovacuum is off, the relay vacuums the table itself when a session
// starts and then every 5,000 rows swept (Config.VacuumEvery). This costs a
// few microseconds of PostgreSQL per event (docs/benchmarks.md); partitioning
// the table by time, the other way to keep it small, would change the schema
// every writer and the polling relay use, for little more.
//
// # Operating it: WAL retention
//
// A slot keeps every WAL segment from its acknowledged position on, for as
// long as it exists. While no relay streams from it (every relay down, a
// crash loop, a broker outage that keeps events unconfirmed), WAL accumulates
// on the server's disk at the rate the whole server writes it, not just the
// outbox. Watch Slot(...).LagBytes (the orders service exports it as a
// metric) and Stats().OldestUnconfirmedAge, and alert well before the disk
// fills. Set max_slot_wal_keep_size on the server to cap what a slot may
// retain: past it, PostgreSQL invalidates the slot ("wal_status = lost") to
// save the server (at its next checkpoint, terminating the WAL sender of a
// relay that streams from it), and the slot can never be streamed from again.
// The relay's next session finds the slot lost, drops it (an operator's too:
// a lost slot retains nothing) and creates a new one, handing every row still
// in the outbox over to polling, as for any new slot: the rows written while
// the slot was lost are among them, so nothing in the outbox is lost, each
// aggregate's events keep their order, and events published but not yet
// swept are published again (duplicates). To free the disk before
// max_slot_wal_keep_size does, stop the relays, drop the slot (Drop) and
// start a relay: the same hand-over follows. Drop the slot of a relay you
// retire for good.
//
// # Failover
//
// Another relay waiting on the same slot (it keeps its publisher connected,
// so its readiness reports the broker) takes over within TakeoverInterval
// once PostgreSQL frees the slot: at once when the active relay's process
// exits or its connection closes, and after wal_sender_timeout (60s by
// default) when its host vanishes without closing the connection.
//
// The relay that takes the slot fences off the one before it, which may
// still run (its replication connection was cut, its host lost the network
// for a while): it bumps the slot's epoch in outbox_wal_slots, a statement
// that waits for any write of the previous session still committing, before
// it reads anything. Every batch a session publishes starts with a statement
// that is conditional on its epoch (the one that records the dispatched
// position), and every sweep, dead letter, hand-over and record of an
// attempt runs in a transaction that first locks the slot's row on the same
// condition. So the
// previous relay starts no batch, retries nothing and writes nothing once it
// is fenced off; it stops, and waits for the slot again. The batches it had
// already sent when it was fenced off may still be confirmed: the new relay
// publishes those events again (duplicates, which consumers absorb), and
// since it saw every write of the old one, an event of an aggregate never
// goes out ahead of an earlier event the old one dead-lettered.
// outbox_wal_slots.holder names the process that holds the slot (host and
// pid) and taken_at since when.
//
// A session acknowledges only positions it read from its own stream, and
// binds everything it does to the server it streams from (its system
// identifier and timeline, recorded in outbox_wal_slots.server): a pool
// connection that still reaches another server (a switchover in progress) is
// closed, and every fenced statement checks the server it runs on. A session
// that finds the slot last used from another server (a promoted standby, a
// restore, a switch to another server behind the same address), or a slot no
// relay has used yet (one an operator made; never dropped), cannot tell
// whether the rows in the outbox are all in the slot's stream: it moves the
// slot on to the server's current position and hands every row over to
// polling before it streams, as at slot creation. (The skipped stream held
// nothing more, and may not be decodable at all: an operator's slot made
// before the relay's publication fails "publication does not exist" before
// PostgreSQL 18.) Events published but not swept before the switch then go
// out again (duplicates); none is lost. Before PostgreSQL 17, logical slots are not copied to physical
// standbys: after a failover the new primary has no slot, and the relay
// creates one, handing over whatever is in the outbox then. A slot whose
// position is ahead of the server's WAL (acknowledged on another server)
// would skip every transaction below it: the relay makes it again if a relay
// made it, and refuses an operator's.
//
// # What PostgreSQL needs
//
//   - wal_level = logical (a restart to change it), a free replication slot
//     and WAL sender (max_replication_slots, max_wal_senders), and
//     max_slot_wal_keep_size to cap what a slot may retain (see "Operating
//     it: WAL retention").
//   - A role with the REPLICATION attribute, for the replication connection
//     (IDENTIFY_SYSTEM, CREATE_REPLICATION_SLOT, START_REPLICATION), made
//     from the pool's settings with replication=database; it cannot go
//     through PgBouncer, so point the pool (or a second pool for the relay)
//     at PostgreSQL directly.
//   - On the outbox tables, what the polling relay needs (SELECT, UPDATE,
//     DELETE on outbox; INSERT on outbox_published with Config.Archive), plus
//     the right to create the publication (owner of the outbox table, or
//     CREATE on the database and ownership of the table, as PostgreSQL
//     requires for CREATE PUBLICATION ... FOR TABLE) and the table
//     outbox_wal_slots (CREATE on the schema) the first time; create both
//     yourself (Schema, and the publication with Prepare run by a
//     privileged role) and the relay needs neither. To create a slot
//     yourself, create the publication first: pgoutput cannot decode, from a
//     slot made before its publication, the transactions committed in
//     between. The relay uses a slot it finds and never drops it (it hands
//     the outbox over to polling, since it cannot tell what the slot
//     covers), unless a relay made it and it is ahead of the server's WAL.
//   - pg_control_system() and pg_current_snapshot(), which every role may
//     call: the relay names the server it streams from and checks that
//     transactions are visible before it publishes their events.
//
// Managed services: Amazon RDS and Aurora set rds.logical_replication = 1
// and grant rds_replication; Google Cloud SQL sets cloudsql.logical_decoding
// = on and the role needs REPLICATION; Azure Database for PostgreSQL sets
// wal_level = logical as a server parameter. PostgreSQL 17 can keep a
// logical slot in sync on a physical standby (a slot created with failover =
// true, and synchronized_standby_slots); the relay does not create such a
// slot, and one created by an operator is used as any slot an operator
// made.
package outboxwal

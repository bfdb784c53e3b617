package chaos

import "slices"

// Faults of the resources the services stand on: a store whose replies are
// lost, a database out of connections, of disk or of fsync speed, a
// transaction that holds rows and the xmin horizon, a replication slot
// invalidated. Each is held for the step's Hold (longer for some, see the
// injector) and healed by the step, and again by the test's healAll. Only
// the long profile has them.
const (
	// The toxiproxy in front of shipping's MongoDB passes the requests
	// upstream but cuts the replies (a limit_data toxic on the downstream
	// only), in windows of a second through the hold: writes land, their
	// acknowledgements never come, and shipping sees errors for writes it
	// made. Measured: effects stored while the replies were cut.
	FaultMongoAckLoss FaultKind = "mongo_ack_loss"
	// The run's own PostgreSQL out of connections: the harness opens
	// sessions until the server refuses new ones (its
	// superuser_reserved_connections keep room for the harness), and holds
	// them. Measured: the sessions held and the refusal seen.
	FaultPostgresMaxConnections FaultKind = "postgres_max_connections"
	// A transaction left open with SELECT ... FOR UPDATE on the oldest
	// pending outbox row of an aggregate and on its order row, holding the
	// xmin horizon: the relays must publish other aggregates meanwhile, and
	// the locked aggregate's events in order afterwards. Measured: rows of
	// other aggregates published during the hold.
	FaultPostgresLongTransaction FaultKind = "postgres_long_transaction"
	// The WAL relay's replication slot invalidated by a small
	// max_slot_wal_keep_size (WAL written past it, checkpoints) until
	// pg_replication_slots.wal_status is 'lost'; the relay must make the
	// slot again and hand the outbox's rows over to polling. WAL relay mode
	// and the run's own PostgreSQL only.
	FaultWALSlotInvalidated FaultKind = "wal_slot_invalidated"
	// The run's own PostgreSQL's data directory (pg_wal included) on a
	// filesystem of its own, shrunk to what it holds: every write that needs
	// a new block (a table or index that grows, a new WAL segment) fails
	// with "No space left on device" until it grows again. Measured: the
	// errors PostgreSQL logged and a write of the harness refused.
	FaultPostgresDiskFull FaultKind = "postgres_disk_full"
	// The same for the embedded MongoDB's (FerretDB's SQLite) data
	// directory: writes that grow its files fail with "database or disk is
	// full" until it grows again (SQLite reuses the pages it has, so some
	// writes still land).
	FaultMongoDiskFull FaultKind = "mongo_disk_full"
	// fsync=on on the run's own PostgreSQL and every fdatasync and fsync of
	// its processes delayed (strace fault injection), as a slow disk would:
	// every commit waits.
	FaultPostgresSlowFsync FaultKind = "postgres_slow_fsync"
)

// ResourceFaultKinds are the resource faults, in a stable order. Only the
// long profile has them.
var ResourceFaultKinds = []FaultKind{
	FaultMongoAckLoss, FaultPostgresMaxConnections, FaultPostgresLongTransaction, FaultWALSlotInvalidated,
	FaultPostgresDiskFull, FaultMongoDiskFull, FaultPostgresSlowFsync,
}

// OwnPostgresResourceFaultKinds need a PostgreSQL server of the run's own:
// on a shared server they would refuse, fill or slow every other user's
// connections.
var OwnPostgresResourceFaultKinds = []FaultKind{
	FaultPostgresMaxConnections, FaultWALSlotInvalidated, FaultPostgresDiskFull, FaultPostgresSlowFsync,
}

// Keys of Fault.Measures for the resource faults.
const (
	MeasureAckLossErrors      = "shipping_errors"          // mongo_ack_loss: errors shipping logged while replies were cut
	MeasureAckLossApplied     = "effects_without_reply"    // mongo_ack_loss: effects stored while no reply came back
	MeasureSessionsHeld       = "sessions_held"            // postgres_max_connections
	MeasureRefused            = "connections_refused"      // postgres_max_connections: 1 when a new connection was refused
	MeasureOthersPublished    = "other_aggregates_rows"    // postgres_long_transaction: rows of other aggregates published during the hold
	MeasureLockedPublished    = "locked_row_published"     // postgres_long_transaction: 1 once the locked row was published after the hold
	MeasureXminHeldSeconds    = "xmin_held_s"              // postgres_long_transaction: the transaction's age at its end
	MeasureSlotLost           = "slot_lost"                // wal_slot_invalidated: 1 when wal_status was 'lost'
	MeasureSlotRemadeSeconds  = "slot_remade_s"            // wal_slot_invalidated: from 'lost' to a slot streamed from again
	MeasureDiskFullErrors     = "disk_full_errors"         // disk full: writes refused for lack of space (seen by the harness or in logs)
	MeasureFsyncDelayed       = "fsync_calls_delayed"      // postgres_slow_fsync: fdatasync/fsync calls strace delayed
	MeasureCommitMsDuringSlow = "harness_commit_ms"        // postgres_slow_fsync: a harness commit's time under the delay
	MeasureCommitMsBefore     = "harness_commit_before_ms" // postgres_slow_fsync: the same before the delay
)

// resourceFault tells whether k is one of ResourceFaultKinds.
func resourceFault(k FaultKind) bool { return slices.Contains(ResourceFaultKinds, k) }

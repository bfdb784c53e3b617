// Package inbox makes a message consumer apply each message's effect once,
// although the broker delivers it at least once.
//
// # The problem
//
// A broker with acknowledgements delivers a message again whenever it cannot
// be sure the consumer finished with it: the consumer crashed after its
// database write but before its ack, the connection dropped, the ack was lost,
// the producer's relay published the same outbox row twice (a crash between
// the publisher confirm and marking the row published), two consumers got
// copies around a reconnect. Acknowledging before the effect loses the
// message on a crash; acknowledging after it, which is the only safe order,
// means duplicates reach the handler. The inbox absorbs them: it remembers,
// per consumer, the ids of the messages whose effect is done, and skips a
// message it has seen.
//
// The message id must identify the message, not the delivery: the outbox
// sends the outbox row's id and creation time as the AMQP MessageId, the
// same for every redelivery and republish of that row. A message without an id cannot be
// deduplicated and must not be processed: Process refuses it
// (ErrInvalidMessageID); dead-letter it with the reason.
//
// # Use
//
//	// consume applies each delivery's effect once, and acks it only after.
//	func consume(ctx context.Context, db *mongo.Database, deliveries <-chan amqp.Delivery, apply func(context.Context, amqp.Delivery) error) (err error) {
//		in, err := inbox.New(db, inbox.Config{Consumer: "shipping"})
//		if err != nil {
//			return err
//		}
//		defer func() { err = errors.Join(err, in.Close(context.WithoutCancel(ctx))) }()
//		if err := in.EnsureIndexes(ctx); err != nil {
//			return err
//		}
//		for d := range deliveries {
//			_, err := in.Process(ctx, d.MessageId, func(ctx context.Context) error {
//				return apply(ctx, d) // use this ctx: in transaction mode it carries the session
//			})
//			switch {
//			case err == nil: // applied now, or applied before: a duplicate
//				err = d.Ack(false)
//			case errors.Is(err, inbox.ErrHandler), errors.Is(err, inbox.ErrInvalidMessageID):
//				err = d.Reject(false) // dead-letter it (count the handler's failures first)
//			default: // the database failed, or ErrTransient: deliver it again later
//				err = d.Nack(false, true)
//			}
//			if err != nil {
//				return fmt.Errorf("settle message %s: %w", d.MessageId, err)
//			}
//		}
//		return nil
//	}
//
// On a server without TTL indexes (FerretDB), also run
// go in.RunPurger(ctx, DefaultPurgeInterval) (see "Retention").
//
// Acknowledge the delivery only after Process returned without error. A
// record is the inbox's promise that the effect is durable; the ack is the
// consumer's promise to the broker; the second must follow the first. Only
// an ErrHandler is the handler's failure: count those towards a
// dead-letter limit, and retry the rest without counting them as handler
// failures. Bound those retries all the same (by count and by age), then
// dead-letter with the reason: a database error that never clears (a
// missing privilege, say) or a transaction that keeps failing transiently
// would otherwise retry one message for ever.
//
// # Two modes, chosen from the server
//
// ModeAuto asks the server (hello) once: a replica set member (setName) or a
// mongos (msg "isdbgrid") gets ModeTransaction, a standalone server or
// FerretDB gets ModeStandalone.
//
// So ModeTransaction is the production mode: every replica set, which is
// how MongoDB runs in production, gets it. And it has never run against a
// MongoDB server in this repository's CI, which has no replica set (and no
// Docker for one): there its state machine is tested only through the
// transaction seam's fake (see Tests), and the tests against a real replica
// set are skipped. Before you rely on it, run them against one of yours:
//
//	TEST_MONGO_REPLSET_URI='mongodb://host:27017/?replicaSet=rs0' go test -race -count=1 ./pkg/inbox/... ./services/shipping/internal/...
//
// (in a copy of the package, ./<your copy of pkg/inbox>/... alone).
//
// ModeTransaction. Each attempt is one multi-document transaction
// (snapshot read concern, majority write concern): read the record; if it
// is there, abort and answer Duplicate; if not, insert it, run the handler,
// commit. Guarantee: the record and the handler's writes commit together or
// not at all, so a message's effect is applied exactly once within the
// retention window, provided the handler follows the rules below. Nothing is
// recovered inside a transaction: on the server any write error (a
// duplicate key included) aborts it, and every later operation in it fails
// with NoSuchTransaction, so Process aborts and, if the error is transient,
// starts a new transaction.
//   - Transient errors (label TransientTransactionError: a write conflict
//     with a concurrent duplicate, or with the orphaned transaction of a
//     consumer that died holding the record; a failover) are retried with
//     backoff (10ms doubling to 1s) within Config.Transaction.RetryBudget,
//     90s by default: longer than the server's
//     transactionLifetimeLimitSeconds (60s), after which it aborts an
//     orphan. When the budget runs out, Process returns a *TransientError
//     (errors.Is ErrTransient), which is not a handler failure: retry the
//     message later without counting it.
//   - A duplicate key, or a record in the snapshot, is answered Duplicate
//     only after a majority read (read concern majority, outside the
//     aborted transaction) finds the record: the unique index sees the
//     primary's latest data, committed to a majority or not, and a record
//     not yet majority-committed can still be rolled back by a failover.
//     Until a majority read confirms it, Process tries again.
//   - An unknown commit outcome (UnknownTransactionCommitResult) is
//     committed again (a commit is idempotent on the server), never re-run,
//     with backoff within the budget; if still unknown then, the
//     *TransientError has CommitUnknown set, and a redelivery finds either
//     the committed record (Duplicate) or nothing (processed again).
//   - A handler error ends Process at once with ErrHandler, unless it
//     carries TransientTransactionError: then it is retried.
//   - A transaction the server aborted under the handler is retried, and
//     three such attempts in a row are reported as ErrHandler, as is a
//     budget that ends with every attempt aborted so (a handler slower
//     than the transaction lifetime fits only two in 90 s). The server
//     aborted it if the commit of a handler that returned nil fails with
//     NoSuchTransaction, or if the handler itself returns NoSuchTransaction
//     (labelled TransientTransactionError): that is what a handler meets
//     after it swallowed a write error (its next operation, or the commit,
//     finds the transaction gone), and what a handler slower than the
//     server's transactionLifetimeLimitSeconds meets. A failover aborts a
//     transaction once; a write conflict of the handler's own writes is
//     retried without counting, and ends such a run.
//
// Process does not use Session.WithTransaction, which retries for a fixed
// two minutes and around a handler that swallowed an error.
//
// ModeStandalone (no transactions: a standalone mongod, FerretDB). Process
// checks the record, runs the handler, then inserts the record. Guarantee,
// given a handler whose effect is idempotent on its own key (for example an
// update conditional on the message id not being in the document's list of
// applied messages, or on the document's version being the one before the
// message's): the effect is never lost, never applied twice, and a message is
// never recorded before its effect is durable.
//   - The record is written only after the handler's writes were
//     acknowledged: a record always stands for a durable effect.
//   - A crash between the effect and the record leaves the effect without a
//     record; the redelivery runs the handler again, and its idempotence makes
//     that a no-op; then the record is written.
//   - A handler error leaves no record: the redelivery runs the handler again.
//   - Two consumers receiving the same message at once may both run the
//     handler; its idempotence keeps one effect, and both records collapse
//     into one (the second insert's duplicate key is expected).
//
// With Config.Standalone.Lease, ModeStandalone first claims the message: a "processing"
// record with an owner and an expiry. A concurrent duplicate then gets
// ErrInProgress instead of running the handler at the same time (retry it
// later, e.g. through a delay queue); the handler's success turns the claim
// into a done record, its failure deletes the claim. A claim whose holder
// died is taken over once the lease has passed, so a crash delays the
// redelivery by up to one lease. The lease is an optimisation, not the
// guarantee: a handler outliving its lease may run concurrently with the
// taker, and idempotence still keeps one effect. Lease comparisons use the
// consumers' clocks.
//
// # Handler rules
//
// In both modes the handler does its database work with the ctx it is given
// and returns every error it does not fully understand.
//
// ModeTransaction: read before you write, and never recover from a write
// error inside the transaction. A handler that inserts and takes a
// duplicate key for "already applied" cannot work there: the duplicate key
// has aborted the transaction, so the inbox's commit fails (Process reports
// it as ErrHandler, see above) and the message is never recorded. Instead,
// look up what the message would change (the applied version of its
// aggregate, a document keyed by the effect) and decide from what you read:
// applied already (an effect whose inbox record expired, or was written in
// standalone mode) is a no-op returning nil, which records the message; an
// unexpected state is a domain error returned to the caller, wrapped in
// ErrHandler (errors.Is finds it, so the consumer can tell a version
// conflict from a failure); otherwise write, and return the write's error
// as it is. The writes themselves may be plain (not idempotent): the
// transaction keeps them to one.
//
// ModeStandalone: the effect must be idempotent on its own key, because the
// handler can run twice for one message (a crash between the effect and the
// record, a record buffered and lost, two consumers at once). A unique key
// whose duplicate-key error means "already applied" is the safe guard; on
// FerretDB it is the only one (see below). The same read-first handler
// written for transaction mode is right here too, provided its final write
// is guarded by such a key and its duplicate key is returned, or treated as
// applied.
//
// Without transactions the inbox cannot make a non-idempotent handler safe:
// ModeStandalone moves the duplicate check into the handler's own
// conditional write, and the record turns redeliveries into cheap skips. In
// ModeTransaction the handler's writes may be plain, but side effects outside
// the database (an e-mail, an HTTP call) are not rolled back with the
// transaction and are at-least-once in both modes.
//
// # Durability
//
// In ModeTransaction the commit uses write concern majority with j: true: a
// record and its effect are in the on-disk journal of a majority of the
// replica set before Process returns. (With majority alone, whether the
// members acknowledge before or after their journal write is the server's
// writeConcernMajorityJournalDefault, true unless an operator changed it;
// the explicit j: true does not depend on it.) Transactions run on the
// primary whatever read preference the client has (a readPreference in the
// connection string): the server refuses a transaction on a secondary.
//
// In ModeStandalone the inbox's record writes use a journaled write concern
// (j: true). On a single mongod the journal is one ordered log, so a record
// journaled after the handler's writes were acknowledged also makes those
// writes durable: a mongod crash after Process returned loses neither.
// Without FlushInterval that holds whatever write concern the handler uses.
// With FlushInterval the record is written after the message was
// acknowledged, so a mongod crash within its journal commit interval (100ms
// by default) after a handler's unjournaled write can lose that effect
// after the ack: if that matters, have the handler write with j: true, or do
// not buffer records.
//
// # Fewer round trips: the done cache and buffered records
//
// In ModeStandalone a message costs three operations: the lookup, the
// handler's write, the record. Two options cut that; neither changes the
// rule that a done record is written only after the handler's effect was
// acknowledged.
//
// The done cache (Config.DoneCacheSize, on by default with 10000 entries, in
// every mode) keeps, per Inbox and in memory, the ids of the messages this
// Inbox knows are done: it wrote (or buffered) their record, its transaction
// committed, or a lookup found the record. Process consults it before
// anything else, and a hit is a Duplicate with no database operation: the
// redeliveries a consumer sees most (its own, moments after the original,
// because an ack was lost or a relay republished) cost nothing. Done is
// final, so a hit is right, even after retention purged the record (a late
// duplicate that the cache still knows is skipped instead of being processed
// again). In ModeTransaction that holds because only majority-committed
// records enter the cache (a commit with write concern majority, or a read
// with read concern majority: the duplicate check and IsDone); a record only
// the primary had could still be rolled back by a failover, and is never
// cached. The cache is bounded and evicts the oldest id first; a
// miss, an evicted id, or a message another consumer instance recorded, is
// looked up in the database as before. Disable it (-1) only to observe the
// database's behaviour, e.g. in tests of retention.
//
// Buffered done records (Config.Standalone.FlushInterval, without a Lease)
// move the record's write out of the message's path: after the
// handler succeeded, Process puts the record in an in-memory buffer (and in
// the cache) and returns Processed at once; a background flusher writes the
// buffer with one unordered InsertMany every FlushInterval, or as soon as
// FlushBatch records wait, so a message costs the lookup and the handler's
// write, plus a share of a bulk insert. IsDone and Process treat a buffered
// record as done. A duplicate key in the bulk insert is settled as in the
// unbuffered path (a concurrent duplicate recorded it, or a Lease-mode claim
// is there and is turned into done); any other failure keeps the record in
// the buffer, is logged (message_id, error, attempt) and is retried at the
// next flush, with a growing pause while failures last. The buffer holds at
// most Standalone.MaxBufferedRecords (16 × FlushBatch by default): when it is
// full, Process writes its message's record itself before returning, so
// while the database keeps failing Process fails too (no ack) instead of
// the buffer growing. Close stops the
// flusher and writes what is buffered; call it at shutdown, after the
// consumer stopped acknowledging, with a deadline.
//
// The trade-off: a message is acknowledged while its record may still be in
// memory. If the process dies before the flush, the record is lost, never
// the effect (the handler's writes were acknowledged before the record was
// buffered). A later redelivery of that message then finds no record, runs
// the handler again, and the handler's idempotence, which ModeStandalone
// requires anyway, makes that run a no-op; the record is written then. So
// buffering costs at most a rerun of the idempotent handler for the messages
// of the last FlushInterval before a crash, and never a lost or doubled
// effect. It takes the record's write out of each message's path, which
// matters where every round trip is expensive (on FerretDB each costs about
// a millisecond of server CPU).
// Use it with an idempotent handler on a standalone server or FerretDB; a
// small interval (10ms) keeps the window short and the batches useful. It
// lives in Config.Standalone, which New refuses with ModeTransaction (there
// the record commits with the effect, in the same round trips); it is
// refused with a Lease (a claim is turned into done synchronously), and
// FlushBatch or MaxBufferedRecords without it are refused. With ModeAuto,
// Config.Standalone applies when the server has no transactions and
// Config.Transaction when it has: a service that runs on both configures
// both.
//
// # The session-context rule
//
// MongoDB's transaction travels in the context (mongo.NewSessionContext), not
// in an explicit argument as a pgx.Tx does. The handler receives that context
// and must use it for every read and write that belongs to the message: a
// write made with another context (a context captured from outside the
// handler, context.Background()) commits on its own, outside the
// transaction, even if the transaction later aborts. Do not start goroutines
// that use the session context either: a session is not safe for concurrent
// use. In ModeStandalone the context is a plain one, and the same handler
// works unchanged.
//
// # Observing Process: Hooks
//
// Config.Hooks observe the steps of each Process call without changing
// them: StepCheck (is the message recorded already: the done cache, the
// lookup, the claim, or in ModeTransaction each attempt's read and insert of
// the record) and StepRecord (the done record written or buffered, or the
// transaction committed). StartStep may return a context for the step (a
// tracing span in it); the step's database operations use it and EndStep
// receives it with the step's StepResult (Duplicate, Cached, Buffered,
// Err). The handler always runs with Process's own context, so the caller
// observes the effect by wrapping its handler, and learns whether a message
// was a duplicate from Process's Result (or from StepCheck's). The package
// itself imports no tracing library; the optional package inboxotel turns
// the hooks into OpenTelemetry spans.
//
// # Retention
//
// A done record carries expire_at = processed_at + Retention. EnsureIndexes
// creates a TTL index on expire_at where the server has TTL indexes; FerretDB
// answers NotImplemented, and then a plain index is created and RunPurger (or
// Purge) deletes expired records with one DeleteMany on expire_at.
// FerretDB's SQLite backend pushes no filter but {_id: x} down to SQLite, so
// there each purge reads the whole collection once (the plain index does
// not help it): its cost grows with the collection (about 0.5s at 5,000
// records and 2s at 20,000 on the repository's CI machine), and lookups
// made meanwhile wait up to tens of milliseconds. Deleting in batches by
// _id, the filter FerretDB does push down, measured slower (each such
// delete is a write transaction of its own there). Run the purger every
// hour or so (DefaultPurgeInterval), not every second; BenchmarkPurge
// measures both. A duplicate that arrives after its record
// expired is processed again, so Retention must exceed the longest delay
// between a message's first delivery and its last possible redelivery:
//   - the outbox relay's redelivery after a crash between publish and mark
//     (its claim timeout plus its longest backoff),
//   - an operator's retry of a dead-lettered outbox row (a row published but
//     never marked can be dead-lettered and retried days later),
//   - replays from the consumer's dead-letter or delay queues.
//
// The default, 7 days, covers the outbox's automatic redeliveries by orders
// of magnitude; set it above the window your operators may take to replay
// dead letters. A consumer whose effect is idempotent by itself (as
// ModeStandalone requires) stays correct after expiry; only the cost of a
// late duplicate changes.
//
// Retention is the inbox's dedup horizon: past it, a redelivery is applied
// again. When the message id says when the message was created (pkg/outbox's
// ids do), Config.MessageTime turns the horizon into a refusal: a message
// older than the retention whose record is gone gets ErrBeyondHorizon, the
// handler does not run, and the consumer parks or dead-letters it for an
// operator (shipping dead-letters it as beyond_dedup_horizon). A message
// that is old on its first delivery (a consumer down longer than the
// retention) is refused the same way: the inbox cannot tell it from one it
// forgot.
//
// # Version order
//
// The inbox deduplicates by message id, so it applies an aggregate's
// messages in the order they arrive, and a broker delivers a retried earlier
// message after a later one. Gate keeps each aggregate's messages in version
// order, for a handler blind to order:
//
//	gate, err := inbox.NewGate(in, inbox.GateConfig{})
//	res, err := gate.Process(ctx, msgID, inbox.Position{Aggregate: orderID, Version: v}, handler)
//	// errors.Is(err, inbox.ErrGap): redeliver later (a delay queue), bounded, then park or dead-letter
//
// It marks each applied version in a collection of its own (one document per
// consumer, aggregate and version, inserted once, read by _id) and runs
// version n only when n-1 is marked (FirstVersion needs none). A version
// this message holds is AlreadyApplied (no handler run), one another
// message holds a *ConflictError. Gate.Skip marks a version without an
// effect (a discarded message, or an aggregate's last version applied
// before the gate). The order of writes is effect, mark, record:
//
//   - crash after the effect, before the mark: the redelivery runs the
//     (idempotent) handler again; later versions wait meanwhile;
//   - crash after the mark, before the record: the redelivery finds the
//     mark, AlreadyApplied;
//   - a mark before the effect would let n+1 pass a lost n.
//
// Marks are only inserted, so a check that n-1 is there cannot go stale,
// also on FerretDB. In ModeTransaction the reads, the mark, the record and
// the effect share the transaction. Marks do not expire.
//
// # Failure modes
//
//   - MongoDB unreachable: Process returns the driver's error. Do not ack;
//     pause consuming and retry when the server is back (nacking with
//     requeue burns the broker's delivery limit and spins).
//   - Crash after the effect, before the record (ModeStandalone): the
//     redelivery re-runs the idempotent handler; one effect.
//   - Crash after the record, before the ack: the redelivery is a Duplicate,
//     acked without running the handler.
//   - Crash with records still buffered (FlushInterval), before or after the
//     ack: those records are lost; a redelivery re-runs the idempotent
//     handler and records the message; one effect.
//   - MongoDB unreachable while records are buffered: the flusher keeps them
//     and retries, logging each failure; Close returns an error naming the
//     records it could not write before its deadline.
//   - Commit outcome unknown (ModeTransaction): committed again within
//     Transaction.RetryBudget; if still unknown, a *TransientError with
//     CommitUnknown and no ack; the redelivery finds either the committed
//     record (Duplicate) or nothing (processed again).
//   - Handler error: ErrHandler; nothing recorded, nothing committed in
//     ModeTransaction. Retry with a bound and dead-letter after it.
//   - A record expired by retention: a late duplicate is processed again.
//   - A consumer that dies inside a transaction (ModeTransaction) leaves it
//     open until the server aborts it (transactionLifetimeLimitSeconds, 60s
//     by default): a redelivery meanwhile meets write conflicts and retries
//     them within Transaction.RetryBudget (90s), so it is applied as soon as
//     the orphan is gone; if the budget runs out first, ErrTransient: retry
//     later, within the bound of such retries (see Use).
//
// # FerretDB
//
// FerretDB (the embedded server of this repository's tests and local runs)
// has no transactions and no TTL indexes, and two more traits shape the
// standalone protocol. Its updates are read-modify-write without isolation:
// two concurrent conditional updates of one document can both apply, or one
// can silently undo the other, so on FerretDB a handler's idempotence must
// rest on a unique key (insert a document whose _id names the effect; a
// duplicate-key error means "already applied"), not on an update's filter.
// And only a filter on a string or ObjectID _id alone is pushed down to
// SQLite; any other filter is evaluated by FerretDB over every document (and
// FerretDB 1.24 as released scans even for that one, because its _id index
// does not match its query; this repository's embedded server adds an index
// that does). Process therefore looks records up by _id
// only and relies on nothing but the unique _id on insert for exclusion; a
// lease takeover is best effort there (two takers may both run the
// idempotent handler).
//
// # Tests
//
// The package's tests need nothing from the repository around them: their
// servers come from internal/inboxtest, which imports only the MongoDB
// driver. The standalone protocol runs on TEST_MONGO_URI (a standalone
// mongod, or FerretDB); in this repository, when it is unset, on an embedded
// FerretDB that the tests start as a command of the repository's own
// (internal/mongolocal/testserver). The transaction state machine
// (transient retries, the budget, unknown commits, aborts, duplicate
// confirmation, a handler that swallowed a write error, the majority read of
// IsDone) is tested without a server, through an unexported seam (txStore)
// that returns the driver's errors with their real labels and codes. The
// tests against a real replica set (an orphaned transaction holding the
// record, an effect without a record, a version conflict, concurrent
// duplicates, rollback, a readPreference in the connection string) run on
// TEST_MONGO_REPLSET_URI, or, in this repository, on a replica set in a
// container where Docker answers; without either they are skipped, also
// under CI=true, and the test binary prints how many did not run and why.
//
// # Copying
//
// Copy this directory, with its subdirectories, into your module, change
// the import paths, and run go mod tidy. Your go.mod then requires:
//
//   - go.mongodb.org/mongo-driver/v2 (the package itself);
//   - go.opentelemetry.io/otel and go.opentelemetry.io/otel/trace
//     (inboxotel only: the OpenTelemetry API; delete inboxotel if you do not
//     trace);
//   - go.opentelemetry.io/otel/sdk (inboxotel's tests only: they record
//     spans in memory and choose samplers);
//   - go.uber.org/goleak (the tests only: no goroutine outlives them);
//   - github.com/rabbitmq/amqp091-go (the tests only: the gate through a
//     RabbitMQ queue, TEST_AMQP_URL, default the local broker);
//
// and their own dependencies, marked indirect; no server, container library
// or embedded database. Run the tests with TEST_MONGO_URI, and
// TEST_MONGO_REPLSET_URI for transaction mode, set to servers of yours.
//
// # Schema
//
// One collection (default "inbox"), one document per (consumer, message),
// whose string _id is "consumer/message id" (a consumer name has no '/'):
//
//	{_id, consumer, message_id, state: "done", processed_at, expire_at}
//	{_id, consumer, message_id, state: "processing", owner, lease_until, expire_at}  // Lease claims
//
// A Gate's marks (default collection "inbox_gate"), _id "consumer/aggregate/version":
//
//	{_id, consumer, aggregate, version, message_id, applied_at, skipped?}
//
// The unique _id makes the pair unique without any secondary index, so a
// missing EnsureIndexes call costs retention, never correctness.
//
// With Config.TallyBucket, a second collection ("inbox_tallies") holds one
// document per (consumer, bucket of creation time), for a loss audit (see
// Tallies):
//
//	{_id: "consumer/width/bucket", count, lo, hi, bucket, expire_at}
//
// There width is TallyBucket as time.Duration's String ("1m0s"), bucket the
// bucket's index (creation time in Unix nanoseconds / TallyBucket); count,
// lo and hi are 64-bit integers (Tally's Count and Digest), bucket the
// bucket's start and expire_at its end + Retention. Done records carry
// expire_at = processed_at + Retention. This layout is a stable format:
// tools may write it (the benchmark seeds a history so), and a change to
// it is a schema change.
package inbox

// Package outbox is a transactional outbox for PostgreSQL: events are written in
// the same transaction as the business change they describe, and a relay
// publishes them to a message broker afterwards, at least once and in order per
// aggregate.
//
// # The problem
//
// A service that saves an order and then publishes "order.created" performs two
// writes to two systems that share no transaction. Sooner or later one succeeds
// and the other does not: the broker is down after the commit, the process is
// killed between the two calls, the publish times out although the broker kept
// the message. Publishing first only moves the gap: consumers then hear about
// orders that were rolled back. No ordering of the two calls makes them atomic,
// and a retry loop in the request path is only as durable as the process
// running it.
//
// The outbox removes the second write from the request path. The service
// inserts the event into an outbox table inside its own transaction, so the
// order and its event commit or vanish together. A relay, running beside the
// service or in other processes, reads committed events from the table,
// publishes them, and records that the broker accepted them.
//
// # The guarantee
//
// Every committed event is published at least once. An event is marked
// published only after the broker confirmed it (for RabbitMQ: a positive
// publisher confirm and no basic.return), so a crash, a lost connection or a
// timeout can only cause a second publish, never a loss. Consumers must
// therefore deduplicate; the message id (MessageID: the outbox row's id and
// its creation time) is the same at every retry, and is the key to
// deduplicate on. It stays unique when a failover to an asynchronous standby
// hands out again ids the lost primary had published under.
//
// Order per aggregate (an AggregateType and AggregateID pair, e.g. one
// order), with any number of relays, across retries and crashes: the first
// copies of an aggregate's events reach the broker in version order unless a
// publish fails; the events of a run behind a failed one go out again after
// it, so their last copies arrive after its; a copy sent again (a lost
// confirm, a lease that ended mid-publish) can arrive after later events.
// Every message carries its aggregate_version (1, 2, ... without gaps): a
// consumer that applies version v only after v-1, and drops what it applied,
// sees each aggregate in order. (An event is handed to a publisher only once
// every earlier event of its aggregate was confirmed or discarded, or behind
// it in the same run; see "How the relay works".) A failing event holds back
// the later events of its own aggregate only; other aggregates flow.
//
// Not guaranteed: exactly-once delivery (deduplicate on the consumer side), any
// order across aggregates, and order on the consumer side when several
// consumers share a queue (route an aggregate to one consumer, or detect gaps
// by version).
//
// # Minimal use
//
// Run Migrate from a deployment step (it is safe at every start too: on an
// up-to-date schema it reads the catalog and locks nothing), and CheckSchema
// when a process starts. A real upgrade takes each table lock with a short
// lock_timeout, retrying with backoff while business transactions hold the
// table (and logging which), and builds new indexes CONCURRENTLY, so readers
// and writers are never queued behind it for longer than that timeout (see
// MigrateWithConfig). Schema is the same SQL for your own migration tool; run
// as is, it takes those locks without the timeout. CheckSchema reads the
// catalog only and fails with ErrSchemaMissing or ErrSchemaOutdated, or with
// ErrSchemaTooNew when a later version of this package migrated the database
// and does not let this one run (Schema records its version, and the oldest
// version that may run against it, as the comment of the outbox table).
// Then write each event in the transaction that changes the business state,
// and run a relay, here with the RabbitMQ publisher of package outboxamqp:
//
//	// placeOrder stores an order and its event in one transaction: both or neither.
//	func placeOrder(ctx context.Context, pool *pgxpool.Pool, orderID string, payload []byte) error {
//		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//			if _, err := tx.Exec(ctx, "INSERT INTO orders (id) VALUES ($1)", orderID); err != nil {
//				return fmt.Errorf("insert order %s: %w", orderID, err)
//			}
//			_, err := outbox.Enqueue(ctx, tx, outbox.Message{
//				AggregateType: "order",
//				AggregateID:   orderID,
//				EventType:     "order.created",
//				Payload:       payload, // JSON
//			})
//			return err // ErrInvalidMessage: the broker could never take it; nothing is written
//		})
//	}
//
//	// runRelay publishes the committed events to RabbitMQ until ctx ends.
//	func runRelay(ctx context.Context, pool *pgxpool.Pool, amqpURL string) error {
//		if err := outbox.CheckSchema(ctx, pool); err != nil {
//			return err // ErrSchemaMissing: outbox.Migrate has not run
//		}
//		pub, err := outboxamqp.NewPublisher(outboxamqp.Config{URL: amqpURL, Exchange: "orders.events"})
//		if err != nil {
//			return err
//		}
//		relay, err := outbox.NewRelay(pool, pub, outbox.RelayConfig{})
//		if err != nil {
//			return errors.Join(err, pub.Close())
//		}
//		return errors.Join(relay.Run(ctx), pub.Close()) // Run returns nil once ctx ends
//	}
//
// Call relay.Wake after a commit to publish now rather than at the next poll.
//
// Enqueue costs one round trip of its own. Writer.Queue puts the same
// statements into the pgx.Batch that carries the business change instead, so
// the change and its events travel together (the orders service does this:
// BEGIN, one batch, COMMIT, the same round trips as without an outbox):
//
//	b := &pgx.Batch{}
//	b.Queue("INSERT INTO orders ...", ...)
//	if _, err := writer.Queue(b, msg); err != nil {
//		return err // invalid message: nothing queued
//	}
//	return tx.SendBatch(ctx, b).Close()
//
// Any type that keeps the contract of Publisher can replace outboxamqp.
//
// # What writers must do
//
// Ordering rests on what Enqueue does, so every event must be written through
// it, inside the transaction that makes the change it describes:
//
//   - Enqueue gives each event the next version of its aggregate by updating the
//     aggregate's row in outbox_aggregates, which locks that row until the
//     transaction ends. Writers of one aggregate are therefore serialised from
//     their Enqueue to their commit, and an aggregate's versions, ids and commit
//     order agree. Enqueue late in the transaction, after the business row is
//     locked or written, so the lock is held briefly.
//   - Keep transactions that enqueue short (milliseconds, not seconds): this is
//     the contract the relay relies on. While a writer's transaction is open,
//     the aggregate's previous event, if still in the outbox, is locked by it
//     and the relay cannot mark it published; the relay retries without
//     waiting, and gives up when less than a quarter of the Lease is left: the
//     event is then published again after the lease (a duplicate). Writers that follow each other
//     back to back do not delay the relay: each holds the previous event only,
//     for its own transaction.
//   - Any isolation level works. At READ COMMITTED (PostgreSQL's default) a row
//     behind an unpublished event is inserted "blocked" and costs the claim
//     nothing until its turn. At REPEATABLE READ and SERIALIZABLE the
//     writer's snapshot may be older than the relay's latest progress, so the
//     row is inserted unblocked: the relay never makes such a writer fail with a
//     serialization error, the claim still publishes the aggregate's events in
//     order, but each such row waiting behind an earlier event of its
//     aggregate costs every claim a little (the claim skips it). Prefer READ
//     COMMITTED for aggregates with long queues. As always at those levels,
//     two writers of one aggregate conflict (SQLSTATE 40001): retry the
//     transaction. The relay's mark and Admin.Discard run at READ COMMITTED
//     whatever the session's default: they rely on a fresh snapshot per
//     statement.
//   - A transaction that enqueues for several aggregates should do so in a
//     consistent order (say, sorted by id), like any code that locks several
//     rows, or concurrent writers can deadlock.
//   - Never insert, update or delete outbox rows by hand: use Admin for
//     operator actions. A row inserted without Enqueue has no correct version
//     and blocked flag.
//   - Never purge or truncate outbox_aggregates, even for aggregates whose
//     events were all published: it holds the last version handed out, and an
//     aggregate whose row is gone starts again at version 1, so consumers that
//     track versions would take its new events for old ones.
//   - Payload must be JSON (it is stored as jsonb: whitespace and key order are
//     normalised on the way, and of duplicate keys in an object only the last
//     is kept, so consumers receive an equivalent document, not the bytes
//     given to Enqueue: a signature over those bytes would not verify).
//     Headers are strings, e.g. W3C trace context.
//   - A message must fit what the broker can take. Enqueue rejects
//     (ErrInvalidMessage, nothing written) an EventType, AggregateType or
//     header name over MaxNameBytes (255: they travel as AMQP short strings,
//     and amqp091-go closes the whole connection on a longer one), a header
//     named CC or BCC (RabbitMQ reads them as lists of routing keys and
//     closes the channel on a string), headers over MaxHeaderBytes measured
//     as the broker measures them (the encoded AMQP field table, with the
//     five headers the publisher adds: 15,000 names of 4 bytes are 60 KB of
//     text but 150 KB on the wire, over RabbitMQ's frame_max), and a Payload
//     over WriterConfig.MaxPayloadBytes (1 MiB by default). A custom
//     outboxamqp RoutingKey must keep its keys within 255 bytes too.
//
// These rules are AMQP's and RabbitMQ's, written out here rather than taken
// from an AMQP client: this package imports none, so that a copy of it
// carries no broker. A hook that the publisher package provides would check
// the same thing, but only where a Writer was built with it; Enqueue, the
// call people copy, would check nothing. For another broker they are
// conservative (short names, at most 64 KiB of headers) and cost nothing to
// keep. And whatever a broker refuses that Enqueue let through (a stricter
// broker, a frame_max set lower than MaxHeaderBytes needs, a rule of a
// future version) cannot block the outbox: a publisher says so with
// ErrBatchRefused, the relay sends each message of that batch alone next
// time without counting the attempt, and the one the broker refuses alone
// fails its attempts and is dead-lettered, while every other row goes out.
//
// # How the relay works
//
// A relay's workers loop: claim a batch, publish it, record the outcome.
//
// Claim. One short statement leases up to BatchSize due rows: it sets their
// next_attempt_at to now + Lease, increments attempts, marks them in flight, and
// commits. An event is claimed only as the head event of its aggregate (the
// oldest one left, see the schema below) or behind it, in the same claim: the
// room the heads leave in the batch is shared among them, and each takes
// the next events of its aggregate in version order (a run), so that a hot
// aggregate drains a batch at a time. SKIP LOCKED keeps concurrent relays
// off each other's rows, and no transaction stays open while talking to the
// broker. There is no id cursor: ids
// are allocated at insert and rows commit in another order, so "id > last seen"
// would skip rows that commit late. Pending is a state of the row, not a range
// of ids.
//
// A due row still marked in flight is one whose relay stopped while publishing
// it: a deploy without a graceful stop, a kill, an out-of-memory, a database
// failover that failed both its mark and its release, or a panic in user code
// such as a routing key function (the relay does not recover panics: a panic
// is a bug to fix, and the process state after one cannot be trusted). Most
// stops are not the row's doing, and a stop leaves every row of the relay's
// batches so: they go back into normal batches, so that a killed relay's
// backlog drains at full speed, and are marked suspect. A row still in flight
// at a second stop in a row is claimed alone, in a batch of its own and with
// nothing else in flight in its process (the relay's other workers wait, and
// claim nothing, from its claim to its mark), so if it is what kills relays
// it takes no other row down with it; and a due
// row that already had MaxAttempts attempts is dead-lettered by the claim,
// with a reason in last_error, instead of being handed to a publisher again
// (and goes out alone if an operator retries it). A row that crashes every
// relay that publishes it therefore costs MaxAttempts crashes, one lease
// apart, the first two with batch-mates, and then waits for an operator like
// any dead letter.
//
// Publish. The whole batch goes to Publisher.PublishBatch, which pipelines it
// and returns one verdict per message within PublishTimeout. The events of a
// run are sent in version order on one channel, so the broker keeps their
// order without waiting for one confirm before the next send. When one of
// them fails, the later ones are not marked, whatever the broker said of
// them: they go out again after it, their attempt given back (a consumer
// that checks versions, as inbox users should, sees them early once and
// drops that copy). An event that failed before gets no run behind it until
// it is published, so a failing event costs its run one early copy, not one
// per retry. The crash rules below hold for each event of a run.
//
// Record. Confirmed rows are moved to outbox_published in one transaction per
// batch (two statements, one round trip), which also unblocks the next event of
// each aggregate. A row the writer of its aggregate's next event holds (see
// "What writers must do") is skipped and marked again a moment later, without
// waiting on the writer. Failed rows keep their error in last_error and get an
// exponential backoff with jitter in next_attempt_at; after MaxAttempts a row is
// dead-lettered: kept in the table, visible through Admin, excluded from claims,
// and holding back its aggregate until an operator retries it, or discards it
// when it can never be published (Admin.Discard). A message the
// publisher says it never sent (ErrNotSent) gets its attempt back.
//
// A relay wakes up on three signals: Wake, called in-process after a commit;
// LISTEN on RelayConfig.NotifyChannel, matched by WriterConfig.NotifyChannel (off
// by default: NOTIFY takes a lock at commit; it passes a transaction-pooling
// PgBouncer, but LISTEN needs a session of its own and does not: see "Behind a
// connection pooler"); and a poll every PollInterval, which alone is enough
// for correctness and also picks up retries and expired leases. The LISTEN
// connection is reopened when it breaks, with a backoff that starts over after
// each successful LISTEN, and when it stays silent past
// RelayConfig.ListenKeepalive and then does not answer a ping (a connection
// that died without an error). Each new LISTEN connection is probed: the
// relay sends a notification to itself through the pool and waits
// ListenProbeTimeout (2s) for it; when it does not come although the
// connection answers a ping, the relay warns, reports
// KindListenFallback to the Observer, relies on the poll alone and probes again
// after ListenProbeRetry.
//
// # Schema
//
// Four tables, created by Migrate (see Schema for the exact SQL):
//
//   - outbox holds the rows not published yet: due, in flight (leased), backing
//     off, blocked behind an earlier event of their aggregate, or
//     dead-lettered. Published rows leave it, so its size is the backlog, never
//     the history. Its autovacuum triggers after a fixed number of changes,
//     not a fraction of its size, so dead index entries do not pile up in front
//     of the claim on a small, hot table (defaults: Migrate keeps the values
//     a DBA sets on the table later). On a server where autovacuum is
//     off, the relay vacuums outbox itself (RelayConfig.VacuumEvery):
//     without any vacuum the claim slows down with every event published
//     since the last one.
//   - outbox_published keeps confirmed rows with published_at, for audit, until
//     they are purged (RelayConfig.PublishedRetention or Admin.Purge, in small
//     batches). The claim never reads it, so the claim's cost does not grow with
//     history. Admin.History reads it through an index by aggregate, which
//     costs each published row one more index entry.
//   - outbox_aggregates holds, per aggregate, the last version handed out. Only
//     writers update it, so the relay never conflicts with a writer's snapshot. Never
//     purge it (see "What writers must do").
//   - outbox_discarded keeps the dead letters an operator discarded
//     (Admin.Discard), with the reason and the time. Nothing purges it.
//
// A row is blocked while an earlier event of its aggregate is still in outbox.
// Enqueue (at READ COMMITTED), holding the aggregate's lock, looks for the
// previous version in outbox; if it is there, Enqueue locks it FOR KEY SHARE
// until commit and inserts its own row blocked. The relay moves a confirmed row
// to outbox_published only if it can lock that row at once (FOR UPDATE SKIP
// LOCKED), and then unblocks the next version in a later statement of the same
// transaction. Either the writer sees the previous row gone and inserts its
// row unblocked, or the relay can move the previous row only after the writer
// committed, and then sees the writer's row: no row stays blocked behind
// nothing, the relay never waits for a business transaction, and only the
// writer of the very next version can hold it back. (An event deleted by
// hand leaves the next one blocked: remove events with Admin.Discard.) The
// claim's index (outbox_due) contains unblocked, non-dead-lettered rows only: its size is the
// number of aggregates with work, and a long queue behind one aggregate costs
// the claim nothing. The claim still checks that each row it takes is its
// aggregate's oldest: ordering rests on that check for rows written unblocked
// at REPEATABLE READ or SERIALIZABLE.
//
// # Failure modes
//
//   - Relay killed before publishing: its rows stay leased and are claimed again
//     when the lease ends, with the attempt counted, in normal batches (the
//     same drain rate as any backlog); only a row that was in flight at two
//     stops in a row is retried alone.
//   - Relay killed after the broker confirmed, before the mark: the rows are
//     published again after the lease. Consumers see a duplicate with the
//     same message id.
//   - Broker down, at start or later: Publisher.WaitReady blocks and
//     reconnects with backoff, nothing is claimed, no attempt is spent, the
//     outbox grows and drains after recovery. Run does not return.
//   - Connection lost with confirms outstanding: their outcome is unknown; they
//     are reported failed, retried after a backoff, and may be duplicates.
//   - Broker refuses or returns a message (nack, no queue bound): a failed
//     attempt. Unroutable messages end as dead letters rather than being marked
//     published. A nack or a confirm timeout fails only the batch it came in
//     (outboxamqp gives each batch a channel of its own).
//   - Broker refuses a message by closing its channel or connection, without
//     saying which (ErrBatchRefused): the messages of that batch without a
//     verdict are retried alone, their attempt given back;
//     the refused one then fails alone, attempt after attempt, and is
//     dead-lettered with the broker's reason.
//   - PostgreSQL unavailable: claims fail and are retried with backoff; a mark
//     that fails is retried while the lease lasts, then the batch is published
//     again after the lease. KindClaimFailed, KindMarkFailed and KindUnmarked count
//     these.
//   - The writer of an aggregate's next event is still in its transaction while
//     the previous event is being marked: the relay skips that row and marks it
//     a moment later, within the lease. A steady stream of writers of one
//     aggregate does not delay the relay: each writer holds only the event
//     before its own.
//   - A message that crashes the relay (a panic in user code, an
//     out-of-memory): retried after each lease, alone from its third attempt,
//     dead-lettered by the claim after MaxAttempts, with a reason; the rows of
//     its first two batches are retried (those in both of them alone) and may
//     be duplicates.
//   - The LISTEN connection dies without an error (a partition, an idle-flow
//     timeout): found within twice ListenKeepalive and reopened, counted by
//     KindListenReconnected; meanwhile the poll keeps the relay going.
//   - A publish slower than the lease: impossible by configuration
//     (PublishTimeout is at most Lease/2) unless the broker holds a message past
//     the publisher's own close of the connection; keep the default margins.
//   - Poison event that always fails: dead-lettered after MaxAttempts, its
//     aggregate held back, everything else flowing. Watch Status.DeadLettered.
//     Retry it once the cause is fixed; if it can never be published, discard
//     it (Admin.Discard): it is kept aside with the reason, and the
//     aggregate's next events go out, in order. Consumers never see it.
//
// # How late a duplicate can come
//
// Consumers keep deduplication records for a window; it must cover the longest
// gap between two publishes of one event. An event is published again after a
// failed or unknown outcome once its backoff ends (at most RetryBackoffMax), or
// after a relay died or could not mark once the Lease ends, plus up to
// PollInterval and PublishTimeout: about 5 minutes with the defaults. If the
// attempts in between fail too, their backoffs add up, to at most MaxAttempts
// times RetryBackoffMax (about 100 minutes with the defaults) before the event
// is dead-lettered. A dead letter that an operator retries can be published
// any time later: retrying one older than the consumers' window may deliver a
// duplicate they no longer recognise.
//
// The message id (MessageID) is the row's identity value and its creation
// time to the microsecond, unique within one outbox table only: consumers that
// read events from several outboxes must deduplicate on the source and the id
// together. The creation time keeps it unique when the identity values are
// handed out again: after a failover to an asynchronous standby (whose
// sequence is behind ids the lost primary published under), a restore, or an
// outbox recreated from scratch, which starts its ids again at 1.
//
// # Operating it
//
// Admin lists, retries and discards dead letters, reports Status (pending
// count, dead letters, age of the oldest pending row: alert on the last two)
// and purges published rows. Status runs on every metrics scrape, so its cost
// is bounded, the same with a million pending rows as with none: counts are
// exact up to StatusCountLimit, and above it Pending is PostgreSQL's running
// estimate of the table's rows (Status.PendingEstimated says so).
// Admin.History answers an operator's question about one aggregate: each of
// its events with its state, attempts, last error and headers, across the
// three tables (package outboxaudit reads every event of a window, for a
// loss audit). An Observer receives counters and timings (one method, so
// new kinds break no implementation); alert on KindClaimFailed,
// KindMarkFailed and KindUnmarked growing (database trouble: nothing or not
// everything is being marked) and on KindListenReconnected growing fast.
// The relay logs with slog, with the keys
// event_id, aggregate_id, event_type and attempt on per-event lines. A pgx
// tracer on the relay's pool can time its claims and marks (and the WAL
// relay's sweeps): StatementOf names them.
//
// Each relay worker uses a pool connection only while it claims or marks; a
// relay with NotifyChannel holds one more, outside the pool. Give the relay a
// pool of its own, or one with room to spare: writers queued on a hot
// aggregate's lock hold their connections while they wait, and a relay that
// shares their pool waits behind them for each claim and mark (with 8 writers
// of one aggregate on a pool of 4 connections, 13% of the events went out
// while the writers wrote; with the relay on a pool of its own, all of them). Its memory is
// bounded by the bytes of its batches in flight, not their number: with the
// default BatchSize and Workers, 1,000 payloads of 1 MiB would be 1 GiB, so
// each claim stops at a share of RelayConfig.MaxInFlightBytes (64 MiB in
// all by default), and a payload larger than a worker's share goes alone.
//
// # Behind a connection pooler
//
// Every statement of this package is one round trip on one connection, or a
// transaction of its own (the mark's batch carries its BEGIN and COMMIT), and
// nothing relies on session state: no session-level SET, advisory lock,
// temporary table or prepared statement of its own. So Enqueue, Writer.Queue,
// the relay, Admin and Migrate work through a pooler in transaction mode
// (PgBouncer with pool_mode = transaction), which hands a client a server
// connection for one transaction at a time, once pgx is told not to use named
// prepared statements. They were tested through PgBouncer 1.18 with each of
// the settings below, across PgBouncer restarts.
//
//   - Set default_query_exec_mode in the pool's connection string (or
//     ConnConfig.DefaultQueryExecMode) to cache_describe (recommended: one
//     round trip per statement, the statement parsed each time as an unnamed
//     statement, only its description cached in the process), exec or
//     simple_protocol. pgx's default, cache_statement, prepares named
//     statements ("stmtcache_" and a hash of the query) on whichever server
//     connection runs a query: the next transaction may land on one that
//     does not have it, and since server connections outlive clients, a
//     process started again behind the same PgBouncer collides with the
//     statements its predecessor left there and fails with "prepared
//     statement "stmtcache_..." already exists (SQLSTATE 42P05)", at every
//     start. Do not use describe_exec either: its second round trip may reach
//     another server connection. (PgBouncer 1.21 and later can track
//     protocol-level prepared statements with max_prepared_statements; 1.18
//     cannot.)
//   - The tables are found through the connection's search_path. PgBouncer
//     1.18 does not carry a search_path (or options) startup parameter to the
//     server: it refuses the connection, or drops the parameter silently when
//     it is listed in ignore_startup_parameters, and the pool then works in
//     the role's default schema. Keep the outbox in the default search_path,
//     or set it on the role or the database (ALTER ROLE ... SET search_path).
//   - LISTEN cannot work through the pooler. Give the relay a direct
//     connection for it in RelayConfig.ListenConfig (NOTIFY from writers goes
//     through the pooler fine), or leave NotifyChannel empty and rely on
//     Wake and PollInterval. Without ListenConfig, the relay's probe finds at
//     start that its notifications do not arrive, logs a warning, reports
//     KindListenFallback and polls.
//
// # Copying
//
// Copy this directory, with its subdirectories, into your module, change
// the import paths, and run go mod tidy. Your go.mod then requires:
//
//   - github.com/jackc/pgx/v5 (the package itself);
//   - github.com/rabbitmq/amqp091-go (outboxamqp only: the RabbitMQ
//     publisher);
//   - github.com/jackc/pglogrepl (outboxwal only: logical replication);
//   - go.opentelemetry.io/otel and go.opentelemetry.io/otel/trace
//     (outboxotel only: the OpenTelemetry API);
//   - go.opentelemetry.io/otel/sdk (outboxotel's tests only: they record
//     spans in memory);
//   - github.com/nats-io/nats.go (outboxnats only: the NATS JetStream
//     publisher);
//   - github.com/nats-io/nats-server/v2 (outboxnats's tests only: a NATS
//     server with JetStream, run in the test process);
//   - go.uber.org/goleak (the tests only: no goroutine outlives them);
//
// and their own dependencies, marked indirect. Delete the subpackages you do
// not use, and their modules go with them. The tests need PostgreSQL
// (TEST_DATABASE_URL, default the local server; outboxwal's need
// wal_level=logical) and RabbitMQ (TEST_AMQP_URL, default the local broker);
// outboxnats's run their own NATS server. The publisher conformance kit,
// publishertest, is for your own publisher's tests.
package outbox

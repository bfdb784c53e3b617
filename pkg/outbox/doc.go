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
// orders that were rolled back.
//
// The outbox removes the second write from the request path. The service
// inserts the event into an outbox table inside its own transaction, so the
// order and its event commit or vanish together. A [Relay], in the service or
// in other processes, reads committed events, publishes them, and records that
// the broker accepted them.
//
// # The guarantee
//
// Every committed event is published at least once. An event is marked
// published only after the broker confirmed it (for RabbitMQ: a positive
// publisher confirm and no basic.return), so a crash, a lost connection or a
// timeout can only cause a second publish, never a loss. Consumers must
// therefore deduplicate on the message id ([MessageID]), the same at every
// retry.
//
// Order per aggregate (an AggregateType and AggregateID pair, e.g. one
// order), with any number of relays, across retries and crashes: the first
// copies of an aggregate's events reach the broker in version order unless a
// publish fails; the events of a run behind a failed one go out again after
// it, so their last copies arrive after its; a copy sent again (a lost
// confirm, a lease that ended mid-publish) can arrive after later events.
// Every message carries its aggregate_version (1, 2, ... without gaps): a
// consumer that applies version v only after v-1, and drops what it applied,
// sees each aggregate in order. A failing event holds back the later events
// of its own aggregate only; other aggregates flow.
//
// Not guaranteed: exactly-once delivery, any order across aggregates, and
// order on the consumer side when several consumers share a queue (route an
// aggregate to one consumer, or detect gaps by version).
//
// # Minimal use
//
// Run [Migrate] from a deployment step (on an up-to-date schema it reads the
// catalog and locks nothing, so it is safe at every start; see
// [MigrateWithConfig]; [Schema] is the same SQL for your own migration tool),
// and [CheckSchema] when a process starts. Then write each event in the
// transaction that changes the business state, and run a relay, here with the
// RabbitMQ publisher of package outboxamqp:
//
//	// placeOrder stores an order and its event in one transaction: both or neither.
//	func placeOrder(ctx context.Context, pool *pgxpool.Pool, orderID string, payload []byte) error {
//		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//			if _, err := tx.Exec(ctx, "INSERT INTO orders (id) VALUES ($1)", orderID); err != nil {
//				return fmt.Errorf("insert order %s: %w", orderID, err)
//			}
//			err := outbox.Enqueue(ctx, tx, outbox.Message{
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
// Call [Relay.Wake] after a commit to publish now rather than at the next poll.
// [Writer.Queue] puts the same statements into the [pgx.Batch] that carries
// the business change, so the change and its events cost no round trip of
// their own. Any type that keeps the contract of [Publisher] can replace
// outboxamqp.
//
// # What writers must do
//
// Ordering rests on what [Enqueue] does, so every event must be written
// through it, inside the transaction that makes the change it describes:
//
//   - Enqueue gives each event the next version of its aggregate by updating
//     the aggregate's row in outbox_aggregates, which locks that row until the
//     transaction ends: writers of one aggregate are serialised from their
//     Enqueue to their commit. Enqueue late in the transaction, after the
//     business row is locked or written.
//   - Keep transactions that enqueue short (milliseconds): while one is open,
//     the aggregate's previous event is locked by it and the relay cannot mark
//     that event published; the relay retries without waiting, and gives up
//     when less than a quarter of [RelayConfig.Lease] is left (a duplicate).
//   - Any isolation level works; READ COMMITTED is cheapest for aggregates
//     with long queues (a row written at REPEATABLE READ or SERIALIZABLE
//     behind an unpublished event costs every claim a little). At those
//     levels two writers of one aggregate conflict (SQLSTATE 40001): retry.
//   - A transaction that enqueues for several aggregates should do so in a
//     consistent order (say, sorted by id), or concurrent writers can deadlock.
//   - Never insert, update or delete outbox rows by hand: use outboxadmin. Never
//     purge outbox_aggregates: it holds the last version handed out, and an
//     aggregate whose row is gone starts again at version 1.
//   - Payload must be JSON. It is stored as jsonb, so consumers receive an
//     equivalent document, not the bytes given (a signature over them would
//     not verify). Headers are strings, e.g. W3C trace context.
//   - A message must fit what the broker can take: Enqueue rejects, with
//     [ErrInvalidMessage] and nothing written, names over [MaxNameBytes],
//     headers named CC or BCC, headers over [MaxHeaderBytes] and a payload over
//     [WriterConfig.MaxPayloadBytes].
//
// Those limits are AMQP's and RabbitMQ's, computed here because this package
// imports no AMQP client. A message a broker refuses anyway cannot block the
// outbox: the publisher returns [ErrBatchRefused], the relay sends each
// message of that batch alone, and the refused one is dead-lettered while
// every other row goes out.
//
// # How the relay works
//
// A relay's workers loop: claim a batch, publish it, record the outcome.
//
// Claim. One short statement leases up to [RelayConfig.BatchSize] due rows for
// [RelayConfig.Lease] and counts an attempt. It takes the head event (the
// oldest left) of each aggregate with work and, behind it, the aggregate's next
// events in version order (a run). SKIP LOCKED keeps concurrent relays off each
// other's rows, and no transaction stays open while talking to the broker.
// There is no id cursor: rows commit in another order than their ids.
//
// Publish. The batch goes to [Publisher.PublishBatch], which returns one
// verdict per message within [RelayConfig.PublishTimeout]. When an event of a
// run fails, the later ones are not marked: they go out again after it.
//
// Record. Confirmed rows move to outbox_published in one transaction per
// batch, which unblocks each aggregate's next event. Failed rows get an
// exponential backoff; after [RelayConfig.MaxAttempts] a row is dead-lettered:
// kept, excluded from claims, holding back its aggregate until an operator
// retries or discards it (package outboxadmin). A message the
// publisher never sent ([ErrNotSent]) gets its attempt back.
//
// A row whose relay stopped while publishing it (a kill, an out-of-memory, a
// panic in user code) is claimed again after its lease; at a second such stop
// it goes alone, so a message that kills relays takes no other row down with
// it, and it is dead-lettered after MaxAttempts.
//
// A relay wakes on [Relay.Wake], on NOTIFY ([RelayConfig.NotifyChannel],
// matched by [WriterConfig.NotifyChannel]; off by default), and on a poll
// every [RelayConfig.PollInterval], which alone is enough for correctness.
//
// # Schema
//
// Four tables, created by [Migrate] (see [Schema] for the SQL):
//
//   - outbox: rows not published yet (due, in flight, backing off, blocked
//     behind an earlier event of their aggregate, dead-lettered). Its size is
//     the backlog, never the history.
//   - outbox_published: confirmed rows, for audit, until purged
//     ([RelayConfig.PublishedRetention] or outboxadmin). The claim never
//     reads it.
//   - outbox_aggregates: per aggregate, the last version handed out.
//   - outbox_discarded: the dead letters an operator discarded, with the
//     reason.
//
// The claim's index holds unblocked, non-dead-lettered rows only, so its size
// is the number of aggregates with work and a long queue behind one aggregate
// costs the claim nothing.
//
// # Failure modes
//
//   - Relay killed before publishing: its rows are claimed again when the
//     lease ends, in normal batches.
//   - Relay killed after the confirm, before the mark: the rows are published
//     again after the lease, a duplicate with the same message id.
//   - Broker down: [Publisher.WaitReady] blocks and reconnects, nothing is
//     claimed, no attempt is spent; the outbox drains after recovery.
//   - Connection lost with confirms outstanding: reported failed, retried
//     after a backoff, possibly duplicates.
//   - Broker nacks or returns a message (no queue bound): a failed attempt;
//     unroutable messages end as dead letters, not as published.
//   - PostgreSQL unavailable: claims and marks are retried with backoff; an
//     unmarked batch is published again after the lease ([KindClaimFailed],
//     [KindMarkFailed], [KindUnmarked] count these).
//   - A message that crashes the relay: alone from its third attempt,
//     dead-lettered after MaxAttempts.
//   - Poison event that always fails: dead-lettered, its aggregate held back,
//     everything else flowing. Watch the dead letters; retry it once the
//     cause is fixed, or discard it and the aggregate's next events go out.
//
// # How late a duplicate can come
//
// Consumers keep deduplication records for a window that must cover the
// longest gap between two publishes of one event: the lease or
// [RelayConfig.RetryBackoffMax], plus PollInterval and PublishTimeout, about 5
// minutes with the defaults; failed attempts in between add up to MaxAttempts
// times RetryBackoffMax (about 100 minutes). A dead letter retried later than
// the window may deliver a duplicate the consumers no longer recognise. The
// message id is unique within one outbox table: consumers of several outboxes
// deduplicate on the source and the id together.
//
// # Operating it
//
// Package outboxadmin lists, retries and discards dead letters, reports the
// backlog at a bounded cost (alert on DeadLettered and OldestPendingAge), reads
// one aggregate's history and purges published rows. An [Observer]
// receives counters and timings; the relay logs with slog (event_id,
// aggregate_id, event_type, attempt); [StatementOf] names its statements for a
// pgx tracer. Give the relay a pool of its own, or one with room to spare:
// writers queued on a hot aggregate's lock hold their connections. Memory is
// bounded by [RelayConfig.MaxInFlightBytes]. Alerts and runbooks:
// docs/operations.md; the WAL relay: docs/wal-relay.md.
//
// # Behind a connection pooler
//
// Nothing relies on session state, so Enqueue, the relay, outboxadmin and Migrate
// work through PgBouncer in transaction mode once the pool's connection
// string sets default_query_exec_mode=cache_describe (or exec,
// simple_protocol), the outbox tables are in the role's default search_path,
// and [RelayConfig.ListenConfig] is a direct connection (LISTEN needs a
// session; without it the relay reports [KindListenFallback] and polls). See
// docs/pgbouncer.md.
//
// # Copying
//
// Copy this directory, with its subdirectories, into your module, change the
// import paths, and run go mod tidy. Your go.mod then requires
// github.com/jackc/pgx/v5; github.com/rabbitmq/amqp091-go (outboxamqp),
// github.com/jackc/pglogrepl (outboxwal), go.opentelemetry.io/otel
// and go.opentelemetry.io/otel/trace (outboxotel) and
// github.com/nats-io/nats.go (outboxnats) only for the subpackages you keep;
// the tests add go.uber.org/goleak, go.opentelemetry.io/otel/sdk (spans
// recorded in memory) and github.com/nats-io/nats-server/v2 (a server in the
// test process). The tests need PostgreSQL (TEST_DATABASE_URL;
// outboxwal's need wal_level=logical) and RabbitMQ (TEST_AMQP_URL). The
// publisher conformance kit, publishertest, is for your own publisher's
// tests.
package outbox

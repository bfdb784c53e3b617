// Package e2e is the end-to-end chaos suite: it runs the real services as
// processes, breaks everything they depend on while clients use them, and
// checks afterwards that no order and no event was lost, duplicated or
// reordered (invariants I1-I6 of docs/guarantees.md).
//
// # What runs
//
// TestChaos builds the service binaries once per test binary (go build of
// ./services/orders, ./services/shipping and ./cmd/mongolocal into a
// temporary directory) and starts, for one run:
//
//   - the orders API (RELAY=false) and two standalone relays (`orders
//     relay`, woken across processes by LISTEN/NOTIFY), against the run's
//     own PostgreSQL database, on a PostgreSQL cluster of the run's own
//     (initdb in a temporary directory, postgres as a child process run as
//     the postgres user) so that a fault can restart it, or on
//     TEST_DATABASE_URL's server where that cannot be done (no initdb, no
//     postgres user, CHAOS_OWN_POSTGRES=false; the restart, failover,
//     synchronous-stall, PostgreSQL pause and PostgreSQL path faults are
//     then left out, and the report's identity says why);
//   - two shipping consumers, against the run's own MongoDB database;
//   - MongoDB: cmd/mongolocal (embedded FerretDB, SQLite backend, no
//     transactions: the inbox's standalone mode) as a process that a fault
//     can kill and start again on the same port and data; or, where a Docker
//     engine answers, a single-node MongoDB replica set in a container
//     (testcontainers-go; the inbox's transaction mode);
//   - an embedded toxiproxy (github.com/Shopify/toxiproxy/v2, inside the test
//     process, on 127.0.0.1) between the orders side and RabbitMQ, between
//     shipping and RabbitMQ, and between shipping and MongoDB; and, on the
//     run's own PostgreSQL, between the API (and the harness) and the
//     server and between each relay and the server (one proxy per relay,
//     so that one relay can be cut alone), the proxies a failover switches
//     to the promoted standby.
//
// Each run has its own PostgreSQL database (and cluster), RabbitMQ vhost
// (rabbitmqctl add_vhost and set_permissions, delete_vhost in cleanup) and
// MongoDB database, all named chaos_<random>, so runs and other packages'
// tests never see each other's data.
//
// # What it does
//
// A workload of concurrent clients creates orders with an Idempotency-Key
// (sent again on every retry, and also used as the order's customer_id so a
// committed order names the request that made it), amends a share of them
// right after (POST /orders/{id}/amendments, a seeded 4 to 18 times back to
// back, each with a key of its own and a note naming it, so those orders
// reach 5 to 20 versions and the relays publish runs of one order's events),
// and cancels some of them, at once or a little later. Each operation is retried on transport errors,
// timeouts and 5xx until it gets an answer or gives up, and is recorded as
// ok, failed (a 4xx) or unknown.
//
// Meanwhile a fault plan, drawn from the seed (chaos.NewPlan), injects every
// fault kind at least once at random times:
//
//   - SIGKILL of the orders API, a relay or a shipping consumer, restarted
//     after a pause;
//   - deterministic crash points (CRASH_POINT, internal/crashpoint): the
//     target is restarted armed and kills itself at
//     orders.after_commit_before_response, relay.after_publish_before_mark,
//     shipping.after_effect_before_inbox or shipping.after_inbox_before_ack,
//     then runs unarmed again;
//   - broker outages through toxiproxy: proxy disabled, reset_peer, latency,
//     timeout (bytes swallowed until removed);
//   - rabbitmqctl close_all_connections --vhost V: the broker itself cuts the
//     run's connections;
//   - rabbitmqctl stop_app / start_app (see "Restoring the machine");
//   - pg_terminate_backend of every session on the run's database;
//   - the run's PostgreSQL cluster stopped immediately (SIGQUIT to the
//     postmaster, which is what pg_ctl -m immediate sends: no checkpoint,
//     crash recovery at the next start) and started again;
//   - a database failover: a standby of the run's own PostgreSQL made with
//     pg_basebackup, streaming asynchronously, cut from the primary for a
//     second (what the API acknowledged meanwhile is lost), promoted after
//     the primary is stopped immediately, the PostgreSQL proxy switched to
//     it, the services left running: nothing is done by hand, and the new
//     primary hands out again outbox ids the old one published under
//     (postgres_failover). The dead primary's data directory is then started
//     alone (crash recovery, no replication, a unix socket in its own
//     directory and no TCP port), read with the final state's readers and
//     removed: the checker excuses an acknowledged operation the database
//     lacks only when the dead primary held it;
//   - a synchronous standby stopped while named in synchronous_standby_names:
//     commits wait, and every effect shipping applies meanwhile must be of an
//     order version the primary shows (postgres_sync_stall);
//   - `orders migrate` under load, then the next release's (one more outbox
//     schema version) on the same database beside an open reader, the
//     services of the version before running on (migration_under_load);
//   - every relay SIGKILLed at once with over 1,000 rows in flight, then the
//     same backlog drained without a kill, for the report (relay_mass_kill);
//   - the pause nemesis: SIGSTOP for longer than the others wait before
//     taking the process's work over, then SIGCONT (its state read from
//     /proc proves the stop): a polling relay past its lease while it holds
//     leased rows (caught holding them while the other relays are stopped
//     for a moment; another relay publishes them meanwhile), or, with the
//     WAL relay, the relay holding the slot past wal_sender_timeout and the
//     takeover (the slot must move to the other relay and stay there after
//     SIGCONT) (pause_relay); a shipping consumer with unacked deliveries
//     (pause_shipping); the orders API with requests in flight
//     (pause_orders); the run's own PostgreSQL, its postmaster and each of
//     its children, since each child leads a process group of its own and a
//     stopped postmaster alone only refuses new connections
//     (pause_postgres). healAll sends SIGCONT to every process and server,
//     also when the test fails;
//   - faults on the path to the run's own PostgreSQL, through its proxies
//     (the API's and the harness's, and one per relay): latency, a blackhole
//     without reset (timeout toxic), reset_peer, and one relay cut from
//     PostgreSQL while it still reaches the broker (postgres_relay_cut);
//   - MongoDB outage: the FerretDB process (or the container) killed and
//     started again, and a toxiproxy cut in front of it;
//   - in the long profile only, the resource faults (chaos.ResourceFaultKinds,
//     resourcefaults_test.go), each measured in the report's fault_measures
//     to show it took effect: MongoDB's replies cut while its requests pass
//     (a limit_data toxic on the downstream only: writes land, shipping
//     hears nothing; mongo_ack_loss); the run's own PostgreSQL out of
//     connections (sessions of a role without superuser opened until the
//     server refuses one, the services' sessions terminated and their slots
//     taken too, superuser_reserved_connections left; postgres_max_connections);
//     a transaction holding an xid and FOR UPDATE locks on an aggregate's
//     head outbox row and its order row (postgres_long_transaction: rows of
//     other aggregates must be published meanwhile, the locked row after);
//     the WAL relay's slot invalidated by max_slot_wal_keep_size=1MB and WAL
//     written past it (wal_slot_invalidated, WAL relay only: the relay must
//     make a new slot); the data directory of the run's own PostgreSQL, and
//     of the embedded FerretDB, moved onto a tmpfs of its own and shrunk to
//     what it holds (postgres_disk_full, mongo_disk_full); fsync turned on
//     and every fsync and fdatasync of PostgreSQL's processes delayed 50 ms
//     by strace (postgres_slow_fsync). A kind this machine cannot inject
//     (no PostgreSQL of the run's own, the polling relay, MongoDB in a
//     container, no root to mount, no strace) is left out and the log says
//     why;
//   - poison messages published straight to the exchange: malformed JSON,
//     no MessageId, an unknown event type, a body over shipping's limit.
//     All but the unknown type must end in shipping's dead-letter queue with
//     a reason; the unknown type is acknowledged and logged.
//
// Then it heals everything and waits for the drain: nothing pending in the
// outbox and no message ready or unacknowledged in shipping's queues (main
// and delay), on two polls in a row. Nothing can reach shipping after that,
// so a committed event without its effect is lost, not late; the drain time
// (invariant I5) runs from the end of the load or of the last fault,
// whichever is later. It then reads the final state: orders and outbox rows
// from PostgreSQL; every applied event from shipping's MongoDB collection in
// one query (asking GET /shipments/{id} for each of thousands of orders takes
// minutes on FerretDB), cross-checked against the API for a sample of orders
// and for every poison message's fake order; the dead-letter queue's
// contents; the duplicates shipping absorbed (its
// shipping_events_duplicate_total counter, scraped every second from each
// consumer, by layer, and summed over restarts); and the effects audit:
// shipping's effect log (shipment_effect_log, one entry per run of a
// message's effect, which the shipment's own order/version key cannot
// show), its inbox collection's records, every shipment document, and the
// process runs that wrote the log (each shipping process logs its
// effect_log_writer at start; the supervisor's start and exit lines in its
// log say which run it was, when it ended and whether it was SIGKILLed);
// and what the publish-order tap saw: a queue of the harness's own
// (chaos.publish-order-tap, declared before the load, bound to
// orders.events with shipping's key order.*; a durable classic queue on
// the machine's broker, a quorum queue on a broker of the run's own),
// consumed straight from the broker with manual acks and a new connection
// after each loss, which numbers its deliveries and gives each message id's
// first and last (chaos.PublishOrder), read once the queue is empty.
// chaos.Check turns history and state into the report, written as JSON and
// summed up in one line. A message with a second entry in the effect log is
// a duplicate_effect unless, on FerretDB (standalone inbox), the writer of
// the earlier entry was killed by a fault before its buffered record was
// due, the copies ran within a second of each other, a MongoDB fault held
// the record back, or a fault cut shipping's broker session while the
// earlier run wrote (the consumer cancels its in-flight handlers); with a
// replica set nothing explains it.
//
// TestChaosCheckerSeesTampering proves the suite can fail: after a calm run
// it deletes an applied event from MongoDB, adds an effect of no committed
// event, copies a real event into the dead-letter queue, deletes an
// acknowledged order from PostgreSQL, plants a second effect-log entry of
// an applied message and deletes another's inbox record, and requires the
// report to show each.
//
// # Restoring the machine
//
// Every fault is healed by the step that injected it, again by a deferred
// heal in the test, and again in t.Cleanup (broker app started, proxies
// closed, processes stopped, database dropped or the run's own cluster
// removed, vhost deleted). The test also stops itself 90 seconds before go
// test's -timeout, whose panic would skip all cleanups; and while the broker
// app is stopped, an interrupt (SIGINT, SIGTERM) starts it before the test
// binary exits. Service processes (PostgreSQL and FerretDB included) run in
// their own process group with Pdeathsig, so a crashed test binary leaves
// none behind.
//
// The broker app restart stops the broker for every client on this machine.
// So the short profile leaves it out unless CHAOS_BROKER_RESTART=true, and
// breaks the broker only for the run's own connections (toxiproxy, and
// close_all_connections on its vhost). `make test` runs this package last
// and alone, after every other package, with CHAOS_BROKER_RESTART=true, so
// its short profile injects every fault kind. The long profile (make chaos)
// always includes it, on the RabbitMQ node of its own where it has one (see
// "A broker of the run's own"), so that it stops no other user's broker.
//
// # The cluster profile
//
// CHAOS_PROFILE=cluster (make chaos-cluster) runs the same flow on a
// three-node RabbitMQ cluster of the run's own (rabbitCluster: nodes
// <run>-1@localhost ... beside the machine's broker, which it leaves alone,
// each with its own ports, data, config file and a copy of the Erlang cookie,
// run as the rabbitmq user and joined with rabbitmqctl join_cluster). The
// services' AMQP_URL lists one proxy per node, and the plan adds the node
// faults, one at a time: SIGKILL of a node or of the shipping queue's leader
// with a restart, stop_app/start_app, a node cut away from the clients, two
// nodes killed at once (the majority lost), a node whose data directory is
// wiped before it rejoins, a network partition between nodes (each node in a
// network namespace of its own, nodeNet) and a resource alarm. After each,
// the clients must have left the nodes that went away (clientsLeft); before
// the faults and after the drain, shipping's queues must be quorum queues
// with a member on every node. Broker proxy faults then act on the side's
// proxies to every node. The nodes and namespaces are removed in cleanup.
// See docs/cluster.md.
//
// # A broker of the run's own
//
// A resource alarm (broker_alarm) blocks every publisher of its broker, so
// it is set only on a node of the run's own: the long profile runs on one
// (internal/rabbitnode, topology Nodes=1), as does TestChaosBrokerAlarm,
// and the cluster profile on its three.
//
// # Running
//
//	go test -race -count=1 -v ./e2e/...                                            # short profile, ~2.5 min
//	CHAOS_PROFILE=long go test -race -count=1 -v -run '^TestChaos$' -timeout 60m ./e2e/  # make chaos, ~10 min
//
// Environment:
//
//	CHAOS_PROFILE        short (default), long or cluster
//	CHAOS_SEED           the plan's seed; random when unset, always logged and reported
//	CHAOS_DURATION       load duration, overriding the profile's (e.g. 3m)
//	CHAOS_FAULTS         number of faults, at least one per kind
//	CHAOS_BROKER_RESTART true/false: add or remove the broker app restart
//	CHAOS_PROVIDER       auto (default), local or testcontainers
//	CHAOS_REPORT         report path (default e2e/chaos-report.json)
//	CHAOS_RACE_SERVICES  true builds the services with -race too
//	CHAOS_BUILD_TAGS     go build -tags for the services: a planted bug of make chaos-mutants (chaos.Mutants)
//	CHAOS_KEEP_LOGS      true keeps the process logs (kept anyway on failure)
//	CHAOS_OWN_POSTGRES   false runs on TEST_DATABASE_URL's server, without the restart, failover, stall, PostgreSQL pause and PostgreSQL path faults
//	CHAOS_OWN_BROKER     false keeps the long profile on the machine's broker, without the broker alarm
//	CHAOS_NETNS          false puts the cluster profile's nodes on loopback, without the partition fault
//	TEST_DATABASE_URL, TEST_AMQP_URL   as for every test of the repository
//
// Requirements: RabbitMQ at TEST_AMQP_URL managed by this machine's
// rabbitmqctl (vhosts, close_all_connections, stop_app act on the local
// node), and PostgreSQL's initdb and postgres binaries with a postgres user,
// or TEST_DATABASE_URL's server. Without RabbitMQ or PostgreSQL the tests
// skip, and fail under CI=true. A fault kind left out for lack of a tool
// (a PostgreSQL server or RabbitMQ node of the run's own, network
// namespaces) is logged and listed in the report's identity, and fails the
// run under CI=true unless its variable (CHAOS_OWN_POSTGRES,
// CHAOS_OWN_BROKER, CHAOS_NETNS) was set to false. The disk-full faults
// need root (mount -t tmpfs), slow fsync strace; TestChaosResourceFaults
// runs each resource fault alone, with CHAOS_PROFILE=long only
// (CHAOS_PROFILE=long go test -run 'TestChaosResourceFaults/<kind>' ./e2e/).
//
// The first lines of the test's log name the seed and the provider
// ("provider: local processes + embedded FerretDB" or "provider:
// testcontainers"); the last one is the report's one-line summary.
//
// The pure parts (history, fault plan, workload client, checker, report)
// live in package chaos, unit-tested without any service.
package e2e

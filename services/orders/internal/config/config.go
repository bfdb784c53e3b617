// Package config reads the orders service's settings from its environment.
// Every setting has a default that works against this machine's local
// services, so the service runs with no configuration at all.
package config

import (
	"cmp"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
)

// Config is the orders service's configuration.
type Config struct {
	// DatabaseURL is DATABASE_URL. Default: postgres://postgres@127.0.0.1:5432/orders?sslmode=disable.
	DatabaseURL string
	// DatabasePooler is DATABASE_POOLER, what DATABASE_URL points at:
	// PoolerNone ("none", the default), PostgreSQL itself or a pooler that
	// gives each client a server session of its own (PgBouncer's
	// pool_mode=session); or PoolerTransaction ("transaction"), a pooler
	// that hands clients server connections one transaction at a time
	// (PgBouncer's pool_mode=transaction). With "transaction" every command
	// (migrate, serve, relay, the CLI) runs its statements without named
	// prepared statements (pgx's default_query_exec_mode cache_describe,
	// unless DATABASE_URL names exec or simple_protocol), and refuses a
	// DATABASE_URL that sets search_path or options, which PgBouncer does
	// not carry to the server. See docs/pgbouncer.md.
	DatabasePooler string
	// ListenURL is OUTBOX_LISTEN_URL: a direct connection to the same
	// PostgreSQL database, bypassing the pooler, for the relays' LISTEN.
	// Default: "" (LISTEN on a connection made from DATABASE_URL). LISTEN
	// cannot work through a transaction pooler: without OUTBOX_LISTEN_URL a
	// relay behind one finds at start that its test notification does not
	// arrive, warns, sets outbox_listen_fallback to 1 and polls every
	// RELAY_POLL_INTERVAL.
	ListenURL string
	// AMQPURL is AMQP_URL. Default: amqp://guest:guest@127.0.0.1:5672/. On a
	// RabbitMQ cluster it lists the nodes' URLs separated by commas; the
	// relay's connection tries them in turn and moves to another node when
	// its own is lost (outboxamqp.Config.URL).
	AMQPURL string
	// HTTPAddr is HTTP_ADDR. Default: 127.0.0.1:8080.
	HTTPAddr string
	// AdminToken is ADMIN_TOKEN, the bearer token of the /admin endpoints.
	// Default: "" (admin endpoints off).
	AdminToken string
	// Relay is RELAY: run the relay inside the API process. Default: true.
	Relay bool
	// RelayMode is RELAY_MODE, which relay runs (serve with RELAY=true, and
	// the standalone relay): RelayModePoll ("poll", the default), the
	// polling relay of pkg/outbox; or RelayModeWAL ("wal"), the relay of
	// pkg/outbox/outboxwal, which reads the outbox's inserts from
	// PostgreSQL's write-ahead log (wal_level=logical, a role with
	// REPLICATION, a direct connection: not behind DATABASE_POOLER=transaction).
	RelayMode string
	// WALSlot is RELAY_WAL_SLOT, the replication slot (and publication) of
	// RELAY_MODE=wal. Default: orders_outbox.
	WALSlot string
	// Envelope is RELAY_ENVELOPE, the form of the messages either relay
	// publishes: EnvelopeOutbox ("outbox", the default), the outbox's own
	// headers; or EnvelopeCloudEvents ("cloudevents"), CloudEvents 1.0 in
	// the AMQP binding's binary content mode, with CloudEventsSource as the
	// source (outboxamqp.Config.CloudEvents). Shipping accepts both, so the
	// switch can be made either way while events are in flight.
	Envelope string
	// CloudEventsSource is RELAY_CLOUDEVENTS_SOURCE, the source attribute of
	// RELAY_ENVELOPE=cloudevents: a URI-reference. Default: /orders.
	CloudEventsSource string
	// Migrate is MIGRATE: the API process (orders serve) creates the database
	// and applies the schemas at start, as `orders migrate` does, for a
	// zero-setup local run. Default: false: only `orders migrate` runs DDL,
	// since the schemas' DDL takes locks that make writers wait (see
	// outbox.CheckSchema), and every other command checks the schema
	// read-only and fails when it is missing or outdated.
	Migrate bool
	// Notify is whether the writer sends a NOTIFY with every write
	// transaction, to wake relays in other processes. OUTBOX_NOTIFY sets it
	// (and Listen) explicitly. Default: true when this process runs no relay
	// (RELAY=false); with an in-process relay, the writer wakes that relay
	// directly and NOTIFY would only add its commit-time cost to every write.
	Notify bool
	// Listen is whether relays LISTEN for those NOTIFYs. OUTBOX_NOTIFY=false
	// turns it off. Default: true.
	Listen bool
	// PollInterval is RELAY_POLL_INTERVAL, the relay's fallback ticker.
	// Default: 1s.
	PollInterval time.Duration
	// BatchSize is RELAY_BATCH_SIZE. Default: 500.
	BatchSize int
	// MaxInFlightBytes is RELAY_MAX_IN_FLIGHT_BYTES, the bytes of payloads
	// and headers a relay holds at once: the polling relay in its batches
	// (outbox.RelayConfig.MaxInFlightBytes), the WAL relay in the events it
	// decoded and has not resolved (outboxwal.Config.MaxInMemoryBytes).
	// Default: 67108864 (64 MiB, outbox.DefaultMaxInFlightBytes).
	MaxInFlightBytes int64
	// MaxAttempts is RELAY_MAX_ATTEMPTS, attempts before a row is
	// dead-lettered. Default: 10.
	MaxAttempts int
	// Retention is OUTBOX_RETENTION, how long published rows are kept.
	// Default: 168h (7 days); 0 keeps them forever.
	Retention time.Duration
	// Lease is RELAY_LEASE, how long a claimed row is reserved for the relay
	// that claimed it; a relay that dies mid-batch has its rows retried by
	// others after it. Default: 30s.
	Lease time.Duration
	// BackoffMin and BackoffMax are RELAY_BACKOFF_MIN and RELAY_BACKOFF_MAX,
	// the bounds of the retry backoff. Defaults: 1s and 5m.
	BackoffMin, BackoffMax time.Duration
	// LogLevel is LOG_LEVEL (debug, info, warn, error). Default: info.
	LogLevel slog.Level
	// Tracing is TRACE_TRUSTED_PEERS, TRACE_BAGGAGE_KEYS,
	// TRACE_BAGGAGE_MAX_BYTES and TRACE_DB (see Tracing).
	Tracing Tracing
}

// Exchange is the topic exchange the relay publishes to (docs/events.md).
const Exchange = "orders.events"

// DATABASE_POOLER values.
const (
	PoolerNone        = "none"
	PoolerTransaction = "transaction"
)

// The relays RELAY_MODE chooses from.
const (
	RelayModePoll = "poll"
	RelayModeWAL  = "wal"
)

// The envelopes RELAY_ENVELOPE chooses from.
const (
	EnvelopeOutbox      = "outbox"
	EnvelopeCloudEvents = "cloudevents"
)

// CloudEvents returns the relays' outboxamqp.Config.CloudEvents: nil for
// the outbox envelope.
func (c Config) CloudEvents() *outboxamqp.CloudEvents {
	if c.Envelope != EnvelopeCloudEvents {
		return nil
	}
	return &outboxamqp.CloudEvents{Source: c.CloudEventsSource}
}

// NotifyChannel is the LISTEN/NOTIFY channel the writer and the relays share.
const NotifyChannel = "outbox_orders"

// FromEnv reads the configuration with getenv (os.Getenv in main).
func FromEnv(getenv func(string) string) (Config, error) {
	c := Config{
		DatabaseURL: cmp.Or(getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/orders?sslmode=disable"),
		AMQPURL:     cmp.Or(getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"),
		HTTPAddr:    cmp.Or(getenv("HTTP_ADDR"), "127.0.0.1:8080"),
		AdminToken:  getenv("ADMIN_TOKEN"),
		ListenURL:   strings.TrimSpace(getenv("OUTBOX_LISTEN_URL")),

		DatabasePooler: strings.ToLower(cmp.Or(strings.TrimSpace(getenv("DATABASE_POOLER")), PoolerNone)),
	}
	if c.DatabasePooler != PoolerNone && c.DatabasePooler != PoolerTransaction {
		return c, fmt.Errorf("DATABASE_POOLER=%q: want %s or %s", getenv("DATABASE_POOLER"), PoolerNone, PoolerTransaction)
	}
	if _, err := outboxamqp.ParseURLs(c.AMQPURL); err != nil {
		return c, fmt.Errorf("AMQP_URL: %w", err)
	}
	var err error
	if c.Relay, err = boolVar(getenv, "RELAY", true); err != nil {
		return c, err
	}
	c.RelayMode = strings.ToLower(cmp.Or(strings.TrimSpace(getenv("RELAY_MODE")), RelayModePoll))
	if c.RelayMode != RelayModePoll && c.RelayMode != RelayModeWAL {
		return c, fmt.Errorf("RELAY_MODE=%q: want %s or %s", getenv("RELAY_MODE"), RelayModePoll, RelayModeWAL)
	}
	if c.RelayMode == RelayModeWAL && c.DatabasePooler == PoolerTransaction {
		return c, fmt.Errorf("RELAY_MODE=%s needs a direct connection to PostgreSQL (logical replication does not pass a pooler): not with DATABASE_POOLER=%s", RelayModeWAL, PoolerTransaction)
	}
	c.WALSlot = cmp.Or(strings.TrimSpace(getenv("RELAY_WAL_SLOT")), "orders_outbox")
	c.Envelope = strings.ToLower(cmp.Or(strings.TrimSpace(getenv("RELAY_ENVELOPE")), EnvelopeOutbox))
	if c.Envelope != EnvelopeOutbox && c.Envelope != EnvelopeCloudEvents {
		return c, fmt.Errorf("RELAY_ENVELOPE=%q: want %s or %s", getenv("RELAY_ENVELOPE"), EnvelopeOutbox, EnvelopeCloudEvents)
	}
	c.CloudEventsSource = cmp.Or(strings.TrimSpace(getenv("RELAY_CLOUDEVENTS_SOURCE")), "/orders")
	if ce := c.CloudEvents(); ce != nil {
		if err := ce.Validate(); err != nil {
			return c, fmt.Errorf("RELAY_CLOUDEVENTS_SOURCE: %w", err)
		}
	}
	if c.Migrate, err = boolVar(getenv, "MIGRATE", false); err != nil {
		return c, err
	}
	if c.Listen, err = boolVar(getenv, "OUTBOX_NOTIFY", true); err != nil {
		return c, err
	}
	c.Notify = c.Listen
	if strings.TrimSpace(getenv("OUTBOX_NOTIFY")) == "" {
		c.Notify = !c.Relay
	}
	if c.PollInterval, err = durationVar(getenv, "RELAY_POLL_INTERVAL", outbox.DefaultPollInterval); err != nil {
		return c, err
	}
	if c.Retention, err = durationVar(getenv, "OUTBOX_RETENTION", 7*24*time.Hour); err != nil {
		return c, err
	}
	if c.Lease, err = durationVar(getenv, "RELAY_LEASE", outbox.DefaultLease); err != nil {
		return c, err
	}
	if c.BackoffMin, err = durationVar(getenv, "RELAY_BACKOFF_MIN", outbox.DefaultRetryBackoffMin); err != nil {
		return c, err
	}
	if c.BackoffMax, err = durationVar(getenv, "RELAY_BACKOFF_MAX", outbox.DefaultRetryBackoffMax); err != nil {
		return c, err
	}
	if c.BatchSize, err = intVar(getenv, "RELAY_BATCH_SIZE", outbox.DefaultBatchSize); err != nil {
		return c, err
	}
	if c.MaxAttempts, err = intVar(getenv, "RELAY_MAX_ATTEMPTS", 10); err != nil {
		return c, err
	}
	inFlight, err := intVar(getenv, "RELAY_MAX_IN_FLIGHT_BYTES", outbox.DefaultMaxInFlightBytes)
	if err != nil {
		return c, err
	}
	c.MaxInFlightBytes = int64(inFlight)
	if err := c.LogLevel.UnmarshalText([]byte(cmp.Or(getenv("LOG_LEVEL"), "info"))); err != nil {
		return c, fmt.Errorf("LOG_LEVEL: %w", err)
	}
	if c.Tracing, err = tracingFromEnv(getenv); err != nil {
		return c, err
	}
	return c, nil
}

func boolVar(getenv func(string) string, name string, def bool) (bool, error) {
	v := strings.TrimSpace(getenv(name))
	if v == "" {
		return def, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return def, fmt.Errorf("%s=%q: want true or false", name, v)
	}
	return b, nil
}

func durationVar(getenv func(string) string, name string, def time.Duration) (time.Duration, error) {
	v := strings.TrimSpace(getenv(name))
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		return def, fmt.Errorf("%s=%q: want a non-negative duration such as 500ms or 2s", name, v)
	}
	return d, nil
}

func intVar(getenv func(string) string, name string, def int) (int, error) {
	v := strings.TrimSpace(getenv(name))
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		return def, fmt.Errorf("%s=%q: want a positive integer", name, v)
	}
	return n, nil
}

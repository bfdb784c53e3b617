package outboxwal

import (
	"cmp"
	"fmt"
	"log/slog"
	"regexp"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// Config configures a Relay. The zero value of every field means its default.
type Config struct {
	// Slot is the logical replication slot the relay reads, created by Run when
	// missing. One relay at a time streams from a slot; others wait. Lower
	// case letters, digits and underscores, at most 63. Default DefaultSlot.
	Slot string
	// Publication is the publication of the outbox table's inserts the slot
	// decodes, created by Run when missing. Default DefaultPublication.
	Publication string
	// BatchSize is how many events one PublishBatch carries: the heads of
	// aggregates, each followed by a run of its aggregate's next events (see
	// the package doc, "Order"). Default DefaultBatchSize (500), at most
	// MaxBatchSize.
	BatchSize int
	// Workers is how many batches are in flight at once. Default DefaultWorkers
	// (4), at most MaxWorkers (64).
	Workers int
	// MaxInMemory bounds the events decoded and not yet confirmed (or handed
	// over) that the relay holds; past it, it stops reading the stream until
	// confirms free room. Default DefaultMaxInMemory (20,000).
	MaxInMemory int
	// MaxInMemoryBytes bounds the bytes of those events' payloads and
	// headers (as the stream delivers them: jsonb's text): past it, the
	// relay stops reading the stream as for MaxInMemory. The event that
	// crosses the bound is kept, so the relay holds at most this plus one
	// event, and always at least one. Default 0, meaning
	// outbox.DefaultMaxInFlightBytes (64 MiB, as the polling relay); -1: no
	// bound but MaxInMemory.
	MaxInMemoryBytes int64
	// PublishTimeout bounds one batch's publish. Default
	// DefaultPublishTimeout (10s).
	PublishTimeout time.Duration
	// MaxAttempts is how many attempts without an outcome (the relay stopped
	// while publishing the event, every time) make the relay dead-letter an
	// event in PostgreSQL: the attempts of events a stopped relay may have
	// had in flight are recorded in their rows before they are made, so a
	// restart does not reset the count (see the package doc). It is also
	// Poll.MaxAttempts unless that is set: an event whose publish fails is
	// handed over to polling at once, and the polling relay retries it with
	// Poll's backoff and dead-letters it after Poll.MaxAttempts attempts in
	// all. Default DefaultMaxAttempts (20).
	MaxAttempts int
	// StatusInterval is how often the relay reports its position to the slot
	// (the standby status update, whose flush position lets PostgreSQL recycle
	// WAL). Default DefaultStatusInterval (1s), at most MaxStatusInterval (10s) (wal_sender_timeout is 60s by default).
	StatusInterval time.Duration
	// SweepInterval is how often the rows of confirmed events are deleted from
	// the outbox table (or moved to outbox_published, see Archive), in one
	// statement. Default DefaultSweepInterval (100ms).
	SweepInterval time.Duration
	// Archive moves the rows of confirmed events to outbox_published, as the
	// polling relay does, instead of deleting them. Default false: delete.
	Archive bool
	// VacuumEvery is how many rows the relay sweeps between two VACUUMs of
	// the outbox table it runs itself, as outbox.RelayConfig.VacuumEvery
	// (the same loop): 0 (auto) vacuums when a session starts and then every
	// 5,000 rows when autovacuum does not cover the table, and never
	// otherwise; -1 never; a positive value at that interval regardless.
	VacuumEvery int
	// TakeoverInterval is how often a relay that waits for the slot (another
	// relay streams from it) tries again. Default
	// DefaultTakeoverInterval (1s).
	TakeoverInterval time.Duration
	// Poll configures the polling relay that publishes the rows this relay
	// hands over: events whose publish failed (it retries them), events that
	// were dead-lettered (once an operator retries them), the later events of
	// their aggregates, and rows the slot's stream does not cover (in the
	// outbox when the slot was created or adopted): an [outbox.Relay] that
	// claims those rows only. Its Logger and Observer default to this
	// Config's, its MaxAttempts to MaxAttempts.
	Poll outbox.RelayConfig
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
	// Observer receives the same kinds of observation as the polling
	// relay's: KindPublished, KindFailed, KindReturned, KindDeadLettered,
	// KindConfirmLatency, KindBatchDuration (one batch's publish) and
	// KindMarkFailed (a sweep or a hand-over failed), and the WAL relay's
	// own KindSwept. Default nil: nothing is observed.
	Observer outbox.Observer
}

// KindSwept (N), the WAL relay's own kind of outbox.Observation: rows of
// confirmed events just deleted (or archived) from the outbox table.
const KindSwept outbox.ObservationKind = "wal_swept"

// Defaults of Config: the value a zero field means.
const (
	DefaultSlot             = "outbox_wal"
	DefaultPublication      = "outbox_wal"
	DefaultBatchSize        = 500
	DefaultWorkers          = 4
	DefaultMaxInMemory      = 20_000
	DefaultPublishTimeout   = 10 * time.Second
	DefaultMaxAttempts      = 20
	DefaultStatusInterval   = time.Second
	DefaultSweepInterval    = 100 * time.Millisecond
	DefaultTakeoverInterval = time.Second
)

// Limits of Config: larger values are refused.
const (
	MaxBatchSize      = 10_000
	MaxWorkers        = 64
	MaxStatusInterval = 10 * time.Second
)

const (
	dbTimeout              = 10 * time.Second
	slotCreateTimeout      = 2 * time.Minute // see ensureSlot
	maxErrorText           = 2000
	sweepChunk             = 10_000
	minInterval            = time.Millisecond
	handedOverIndexName    = "outbox_handed_over"
	handedOverAggIndexName = "outbox_handed_over_aggregates"
)

var namePattern = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

func (c Config) withDefaults() (Config, error) {
	for _, f := range []struct {
		name string
		v    int64
	}{
		{"BatchSize", int64(c.BatchSize)}, {"Workers", int64(c.Workers)}, {"MaxInMemory", int64(c.MaxInMemory)},
		{"PublishTimeout", int64(c.PublishTimeout)}, {"MaxAttempts", int64(c.MaxAttempts)},
		{"StatusInterval", int64(c.StatusInterval)}, {"SweepInterval", int64(c.SweepInterval)},
		{"TakeoverInterval", int64(c.TakeoverInterval)},
	} {
		if f.v < 0 {
			return c, fmt.Errorf("outboxwal config: %s is negative", f.name)
		}
	}
	c.Slot = cmp.Or(c.Slot, DefaultSlot)
	c.Publication = cmp.Or(c.Publication, DefaultPublication)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.Workers = cmp.Or(c.Workers, DefaultWorkers)
	c.MaxInMemory = cmp.Or(c.MaxInMemory, DefaultMaxInMemory)
	c.MaxInMemoryBytes = cmp.Or(c.MaxInMemoryBytes, outbox.DefaultMaxInFlightBytes)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, DefaultPublishTimeout)
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.StatusInterval = cmp.Or(c.StatusInterval, DefaultStatusInterval)
	c.SweepInterval = cmp.Or(c.SweepInterval, DefaultSweepInterval)
	c.TakeoverInterval = cmp.Or(c.TakeoverInterval, DefaultTakeoverInterval)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Poll.Logger == nil {
		c.Poll.Logger = c.Logger
	}
	if c.Poll.Observer == nil {
		c.Poll.Observer = c.Observer
	}
	if c.Poll.MaxAttempts == 0 {
		c.Poll.MaxAttempts = c.MaxAttempts
	}
	switch {
	case !namePattern.MatchString(c.Slot):
		return c, fmt.Errorf("outboxwal config: Slot %q: want 1 to 63 lower case letters, digits or underscores", c.Slot)
	case !namePattern.MatchString(c.Publication):
		return c, fmt.Errorf("outboxwal config: Publication %q: want 1 to 63 lower case letters, digits or underscores", c.Publication)
	case c.BatchSize > MaxBatchSize:
		return c, fmt.Errorf("outboxwal config: BatchSize %d: at most %d", c.BatchSize, MaxBatchSize)
	case c.Workers > MaxWorkers:
		return c, fmt.Errorf("outboxwal config: Workers %d: at most %d", c.Workers, MaxWorkers)
	case c.MaxInMemoryBytes < -1:
		return c, fmt.Errorf("outboxwal config: MaxInMemoryBytes %d: want -1 (no bound), 0 (default %d) or a number of bytes", c.MaxInMemoryBytes, outbox.DefaultMaxInFlightBytes)
	case c.MaxInMemory < c.BatchSize:
		return c, fmt.Errorf("outboxwal config: MaxInMemory %d: at least BatchSize (%d)", c.MaxInMemory, c.BatchSize)
	case c.VacuumEvery < -1:
		return c, fmt.Errorf("outboxwal config: VacuumEvery %d: want -1 (never), 0 (auto) or a number of rows", c.VacuumEvery)
	case c.StatusInterval > MaxStatusInterval:
		return c, fmt.Errorf("outboxwal config: StatusInterval %v: at most %v", c.StatusInterval, MaxStatusInterval)
	case c.StatusInterval < minInterval || c.SweepInterval < minInterval || c.TakeoverInterval < minInterval:
		return c, fmt.Errorf("outboxwal config: StatusInterval, SweepInterval and TakeoverInterval must be at least %v", minInterval)
	}
	return c, nil
}

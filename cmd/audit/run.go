package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/x/mongo/driver/connstring"

	"github.com/outbox-inbox/reference/internal/audit"
	"github.com/outbox-inbox/reference/internal/logfmt"
	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxaudit"
	"github.com/outbox-inbox/reference/services/shipping/accounting"
)

// errNotWhole: the audit found missing events or phantom records.
var errNotWhole = errors.New("the flow is not whole")

// Defaults: the services' own.
const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/orders?sslmode=disable"
	defaultMongoURI    = "mongodb://127.0.0.1:27017"
	defaultMongoDB     = "shipping"
	defaultRetention   = 7 * 24 * time.Hour
	defaultMetricsAddr = "127.0.0.1:9464"
)

// settings are the command's options.
type settings struct {
	databaseURL, mongoURI, mongoDB string
	retention                      time.Duration
	since, until                   bound
	grace, maxDeferral             time.Duration
	consumer, collection           string
	examples                       int
	pageSize, inboxPageSize        int
	accounting                     bool
	every, fullEvery               time.Duration
	metricsAddr                    string
	level                          slog.Level
}

// bound is -since or -until: a time, or a duration before each audit's
// start; unset, the default.
type bound struct {
	at  time.Time
	ago time.Duration
	set bool
}

func (b *bound) String() string {
	switch {
	case !b.set:
		return ""
	case b.at.IsZero():
		return b.ago.String()
	default:
		return b.at.Format(time.RFC3339)
	}
}

func (b *bound) Set(s string) error {
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return fmt.Errorf("%q: a duration before now must not be negative", s)
		}
		*b = bound{ago: d, set: true}
		return nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return fmt.Errorf("%q: want a time (RFC 3339, e.g. 2030-01-02T15:04:05Z) or a duration before now (e.g. 24h)", s)
	}
	*b = bound{at: t, set: true}
	return nil
}

func (b bound) resolve(now time.Time, def time.Time) time.Time {
	switch {
	case !b.set:
		return def
	case b.at.IsZero():
		return now.Add(-b.ago)
	default:
		return b.at
	}
}

func parse(args []string, getenv func(string) string, stdout io.Writer) (settings, error) {
	o := settings{
		databaseURL: cmp.Or(getenv("DATABASE_URL"), defaultDatabaseURL),
		mongoURI:    cmp.Or(getenv("MONGO_URI"), defaultMongoURI),
		retention:   defaultRetention,
	}
	if v := getenv("OUTBOX_RETENTION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return o, fmt.Errorf("OUTBOX_RETENTION=%q: want a positive duration such as 168h", v)
		}
		o.retention = d
	}
	if err := o.level.UnmarshalText([]byte(cmp.Or(getenv("LOG_LEVEL"), "info"))); err != nil {
		return o, fmt.Errorf("LOG_LEVEL: %w", err)
	}
	fs := flag.NewFlagSet("audit", flag.ContinueOnError)
	fs.SetOutput(stdout)
	fs.Var(&o.since, "since", "start of the window: a time (RFC 3339) or a duration before now (default: OUTBOX_RETENTION - grace before now)")
	fs.Var(&o.until, "until", "end of the window, excluded: a time or a duration before now (default: grace before now)")
	fs.DurationVar(&o.grace, "grace", 0, "how long an event may be in flight: younger ones not applied are pending, older ones missing (default -max-deferral-age + 15m)")
	fs.DurationVar(&o.maxDeferral, "max-deferral-age", accounting.DefaultMaxDeferralAge, "shipping's -max-deferral-age: how long it may defer a message before it dead-letters it (the default grace outlasts it)")
	fs.DurationVar(&o.retention, "retention", o.retention, "how long the outbox keeps published rows (env OUTBOX_RETENTION)")
	fs.StringVar(&o.consumer, "consumer", "shipping", "the inbox's consumer name")
	fs.StringVar(&o.collection, "collection", "inbox", "the inbox's collection")
	fs.IntVar(&o.examples, "examples", audit.DefaultExamples, "ids kept as examples in each bucket")
	fs.IntVar(&o.pageSize, "page-size", outboxaudit.DefaultEventLogPage, "outbox rows read per statement")
	fs.IntVar(&o.inboxPageSize, "inbox-page-size", inbox.DefaultRecordedPage, "inbox records read per query (FerretDB reads the whole collection for each: raise it above its size there)")
	fs.BoolVar(&o.accounting, "accounting", true, "ask shipping's stores (shipments, dead letters, parked messages) about events its inbox has no record of")
	fs.DurationVar(&o.every, "every", 0, "audit again at this interval and serve the counts on -metrics-addr (default: once, then exit)")
	fs.DurationVar(&o.fullEvery, "full-every", audit.DefaultFullEvery, "with -every: how often a cycle is a full audit (the cycles between read only what changed, and carry the last full audit's phantoms)")
	fs.StringVar(&o.metricsAddr, "metrics-addr", defaultMetricsAddr, "with -every: where /metrics and /report are served")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	graceSet := false
	fs.Visit(func(f *flag.Flag) { graceSet = graceSet || f.Name == "grace" })
	if !graceSet {
		o.grace = audit.GraceFor(o.maxDeferral)
	}
	cs, err := connstring.ParseAndValidate(o.mongoURI)
	if err != nil {
		return o, fmt.Errorf("MONGO_URI: %w", err)
	}
	o.mongoDB = cmp.Or(cs.Database, defaultMongoDB)
	var problems []string
	if o.grace <= 0 || o.maxDeferral < 0 {
		problems = append(problems, fmt.Sprintf("-grace %v, -max-deferral-age %v: want a positive grace, a deferral age of 0 or more", o.grace, o.maxDeferral))
	}
	if !o.since.set && o.retention <= 2*o.grace {
		problems = append(problems, fmt.Sprintf("-retention %v: want more than twice -grace (%v), or give -since", o.retention, o.grace))
	}
	if o.fullEvery <= 0 {
		problems = append(problems, fmt.Sprintf("-full-every %v: want a positive duration", o.fullEvery))
	}
	if o.every < 0 || o.every > 0 && o.every < time.Second {
		problems = append(problems, fmt.Sprintf("-every %v: want at least 1s (or 0: once)", o.every))
	}
	if o.examples < 0 {
		problems = append(problems, fmt.Sprintf("-examples %d: want 0 or more", o.examples))
	}
	if o.pageSize < 1 || o.pageSize > outboxaudit.MaxEventLogPage || o.inboxPageSize < 1 {
		problems = append(problems, fmt.Sprintf("-page-size %d, -inbox-page-size %d: want 1 to %d, and 1 or more", o.pageSize, o.inboxPageSize, outboxaudit.MaxEventLogPage))
	}
	if len(problems) > 0 {
		return o, errors.New(strings.Join(problems, "; "))
	}
	return o, nil
}

// window returns the audit's window at now.
func (o settings) window(now time.Time) (since, until time.Time) {
	return o.since.resolve(now, now.Add(-o.retention+o.grace)), o.until.resolve(now, now.Add(-o.grace))
}

// auditor holds the connections and runs audits.
type auditor struct {
	opts     settings
	pool     *pgxpool.Pool
	client   *mongo.Client
	events   *outboxaudit.EventLog
	inbox    *inbox.Inbox
	accounts audit.Accountant
	inc      *audit.Incremental // -every's cycles
}

func newAuditor(ctx context.Context, o settings) (*auditor, error) {
	cfg, err := pgxpool.ParseConfig(o.databaseURL)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	// The outbox's streams (one per number of digits) read ahead at the
	// same time, beside the look-ups.
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	client, err := mongo.Connect(options.Client().ApplyURI(o.mongoURI).SetAppName("audit").SetServerSelectionTimeout(10 * time.Second))
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("MongoDB client: %w", err)
	}
	a := &auditor{opts: o, pool: pool, client: client}
	fail := func(err error) (*auditor, error) {
		a.close()
		return nil, err
	}
	if a.events, err = outboxaudit.NewEventLog(pool, o.pageSize); err != nil {
		return fail(err)
	}
	db := client.Database(o.mongoDB)
	// Tallies of a minute, as shipping keeps them (-every's cycles read them
	// before looking events up one by one).
	if a.inbox, err = inbox.New(db, inbox.Config{Consumer: o.consumer, Collection: o.collection, MessageTime: accounting.MessageTime, TallyBucket: audit.DefaultBucket}); err != nil {
		return fail(err)
	}
	if o.accounting {
		if a.accounts, err = accounting.New(db); err != nil {
			return fail(err)
		}
	}
	if o.every > 0 {
		cfg := a.config()
		if a.inc, err = audit.NewIncremental(audit.IncrementalConfig{Config: cfg, Done: a.inbox, Tallies: a.inbox, FullEvery: o.fullEvery, Retention: o.retention}); err != nil {
			return fail(err)
		}
	}
	return a, nil
}

// config is an audit's configuration, but for its window.
func (a *auditor) config() audit.Config {
	examples := a.opts.examples
	if examples == 0 {
		examples = -1
	}
	cfg := audit.Config{
		Producer: a.events, Consumer: a.inbox, Grace: a.opts.grace,
		Examples: examples, InboxPageSize: a.opts.inboxPageSize,
	}
	if a.accounts != nil {
		cfg.Accountant = a.accounts
	}
	return cfg
}

func (a *auditor) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = a.client.Disconnect(ctx)
	a.pool.Close()
}

// audit runs one audit of the window at now: a full one, or with -every a
// cycle of the incremental audit.
func (a *auditor) audit(ctx context.Context, now time.Time) (*audit.Report, error) {
	since, until := a.opts.window(now)
	if !since.Before(until) {
		return nil, fmt.Errorf("empty window: since %s is not before until %s", since.Format(time.RFC3339), until.Format(time.RFC3339))
	}
	if a.inc != nil {
		return a.inc.Cycle(ctx, since, until, now)
	}
	cfg := a.config()
	cfg.Since, cfg.Until, cfg.Now = since, until, now
	// Purges go by published_at, never before created_at: the outbox
	// holds every event created after now - retention (the margin covers
	// this clock against the database's).
	cfg.Horizon = now.Add(-a.opts.retention + audit.DefaultClockSkew)
	return audit.Run(ctx, cfg)
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	o, err := parse(args, getenv, stdout)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	a, err := newAuditor(ctx, o)
	if err != nil {
		return err
	}
	defer a.close()
	if o.every > 0 {
		return a.serve(ctx, logfmt.New(stdout, o.level, "audit"))
	}
	r, err := a.audit(ctx, time.Now())
	if err != nil {
		return err
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return err
	}
	if !r.Whole() {
		return fmt.Errorf("%w: %d missing, %d phantom", errNotWhole, r.Missing.Count, r.Phantom.Count)
	}
	return nil
}

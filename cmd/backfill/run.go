package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/internal/logfmt"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxbackfill"
)

// aggregates is the repeatable -aggregate TYPE/ID flag.
type aggregates []outboxbackfill.Aggregate

func (a *aggregates) String() string { return fmt.Sprint(*a) }

func (a *aggregates) Set(s string) error {
	typ, id, ok := strings.Cut(s, "/")
	if !ok || typ == "" || id == "" {
		return fmt.Errorf("%q: want TYPE/ID, e.g. order/o-1", s)
	}
	*a = append(*a, outboxbackfill.Aggregate{Type: typ, ID: id})
	return nil
}

// timeFlag is -from or -until: a time in RFC 3339, or unset.
type timeFlag struct{ t time.Time }

func (f *timeFlag) String() string {
	if f.t.IsZero() {
		return ""
	}
	return f.t.Format(time.RFC3339Nano)
}

func (f *timeFlag) Set(s string) error {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return fmt.Errorf("%q: want a time in RFC 3339, e.g. 2030-01-02T15:04:05Z", s)
	}
	f.t = t
	return nil
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	var (
		queue, name string
		from, until timeFlag
		aggs        aggregates
		cfg         outboxbackfill.Config
		level       slog.Level
	)
	fs := flag.NewFlagSet("backfill", flag.ContinueOnError)
	fs.SetOutput(stdout)
	fs.StringVar(&queue, "queue", "", "the new consumer's queue, declared and bound already (required)")
	fs.StringVar(&name, "name", "", "the backfill's checkpoint name (default: the queue's name)")
	fs.Var(&from, "from", "replay events created at or after this time (RFC 3339; default: the oldest archived)")
	fs.Var(&until, "until", "replay events created up to this time (default: the first start)")
	fs.Var(&aggs, "aggregate", "replay this aggregate only, TYPE/ID; repeatable (default: all)")
	fs.Float64Var(&cfg.Rate, "rate", outboxbackfill.DefaultRate, "events sent per second at most")
	fs.IntVar(&cfg.BatchSize, "batch", outboxbackfill.DefaultBatchSize, "events per publish and per checkpoint")
	fs.DurationVar(&cfg.ProgressInterval, "progress", outboxbackfill.DefaultProgressInterval, "how often to log the progress")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if queue == "" {
		return errors.New("-queue is required")
	}
	if err := level.UnmarshalText([]byte(cmp.Or(getenv("LOG_LEVEL"), "info"))); err != nil {
		return fmt.Errorf("LOG_LEVEL: %w", err)
	}
	log := logfmt.New(stdout, level, "backfill")
	cfg.Name, cfg.From, cfg.Until, cfg.Aggregates, cfg.Logger = cmp.Or(name, queue), from.t, until.t, aggs, log

	pool, err := pgxpool.New(ctx, cmp.Or(getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/orders?sslmode=disable"))
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	defer pool.Close()
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{
		URL:            cmp.Or(getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"),
		Queue:          queue,
		ConnectionName: "outbox-backfill",
		MaxInFlight:    cfg.BatchSize,
		Logger:         log,
	})
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	b, err := outboxbackfill.New(pool, pub, cfg)
	if err != nil {
		return err
	}
	if err := b.Run(ctx); err != nil {
		return err
	}
	if p := b.Progress(); !p.Finished {
		return fmt.Errorf("stopped at %d of %d events; run again to go on", p.Replayed, p.Total)
	}
	return nil
}

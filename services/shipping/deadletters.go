package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.mongodb.org/mongo-driver/v2/x/mongo/driver/connstring"

	"github.com/outbox-inbox/reference/internal/tracing"
	"github.com/outbox-inbox/reference/services/shipping/internal/deadletter"
	"github.com/outbox-inbox/reference/services/shipping/internal/mongodb"
	"github.com/outbox-inbox/reference/services/shipping/internal/rabbitmq"
)

const deadLettersUsage = `usage: shipping dead-letters <command>

commands:
  list                          dead letters kept in MongoDB, and the orders held behind them
  replay  [-queue Q] ORDER VER  re-publish a dead letter (after a fix) to the queue, then
                                release its order's parked messages in version order
  discard [-queue Q] ORDER VER  skip a dead letter's version in the shipment, then release
                                its order's parked messages in version order

A replay or discard that stopped midway (a crash, the broker gone) resumes
when run again for the same order and version. Reads MONGO_URI and AMQP_URL.
`

// deadLetters is the operator's CLI on the service's dead letters. It works
// on MongoDB and the broker directly, so it needs no running service.
func deadLetters(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	if len(args) == 0 {
		return errors.New("dead-letters: want a subcommand: list, replay or discard\n" + deadLettersUsage)
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("dead-letters "+sub, flag.ContinueOnError)
	fs.SetOutput(stdout)
	queue := fs.String("queue", "shipping.order-events", "the consumer's queue, where released messages go")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("dead-letters %s: %w", sub, err)
	}
	switch sub {
	case "list":
		if fs.NArg() != 0 {
			return errors.New("dead-letters list: takes no arguments")
		}
	case "replay", "discard":
		if fs.NArg() != 2 {
			return fmt.Errorf("dead-letters %s: want ORDER_ID VERSION", sub)
		}
	case "help", "-h":
		fmt.Fprint(stdout, deadLettersUsage)
		return nil
	default:
		return fmt.Errorf("dead-letters: unknown subcommand %q: want list, replay or discard", sub)
	}

	uri := cmp.Or(getenv("MONGO_URI"), "mongodb://127.0.0.1:27017")
	cs, err := connstring.ParseAndValidate(uri)
	if err != nil {
		return fmt.Errorf("MONGO_URI: %w", err)
	}
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(10 * time.Second))
	if err != nil {
		return fmt.Errorf("MongoDB client: %w", err)
	}
	defer client.Disconnect(context.WithoutCancel(ctx))
	db := client.Database(cmp.Or(cs.Database, "shipping"))
	store, err := deadletter.NewStore(db)
	if err != nil {
		return err
	}
	shipments, err := mongodb.New(db, "")
	if err != nil {
		return err
	}
	// A re-published message gets a span in the trace kept with it (with
	// OTEL_EXPORTER_OTLP_ENDPOINT set; otherwise its kept headers go out as
	// they are, in that trace all the same).
	tel, err := tracing.Setup(ctx, "shipping", nil)
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tel.Shutdown(sctx)
	}()
	pub := &rabbitmq.ReplayPublisher{
		URL: cmp.Or(getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"), Queue: *queue,
		TracerProvider: tel.TracerProvider, Propagator: tel.Propagator,
	}
	defer func() { _ = pub.Close() }()
	m, err := deadletter.NewManager(deadletter.Config{Store: store, Publisher: pub, Skipper: shipments})
	if err != nil {
		return err
	}

	if sub == "list" {
		letters, holds, err := m.List(ctx)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ORDER\tVERSION\tEVENT\tMESSAGE\tREASON\tHOLDS\tDEAD SINCE\tERROR")
		for _, l := range letters {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%t\t%s\t%s\n", l.OrderID, l.Version, l.EventType, l.Message.MessageID,
				l.Reason, l.Holds, l.DeadLetteredAt.Format(time.RFC3339), l.Error)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintln(stdout)
		tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "HELD ORDER\tDEAD VERSION\tSTATE\tPARKED\tOLDEST PARKED")
		for _, h := range holds {
			oldest := "-"
			if h.OldestParkedAt != nil {
				oldest = h.OldestParkedAt.Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\n", h.OrderID, h.Version, h.State, h.Parked, oldest)
		}
		return tw.Flush()
	}

	orderID := fs.Arg(0)
	version, err := strconv.ParseInt(fs.Arg(1), 10, 64)
	if err != nil || version < 1 {
		return fmt.Errorf("dead-letters %s: %q is not a positive version", sub, fs.Arg(1))
	}
	do, done := m.Replay, "replayed"
	if sub == "discard" {
		do, done = m.Discard, "discarded"
	}
	n, err := do(ctx, orderID, version)
	if err != nil {
		return fmt.Errorf("dead-letters %s %s %d: %w (run it again to resume)", sub, orderID, version, err)
	}
	fmt.Fprintf(stdout, "%s %s version %d; released %d parked messages\n", done, orderID, version, n)
	return nil
}

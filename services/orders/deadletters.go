package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// deadLetters is the operator's CLI on the outbox's dead letters. It works on
// the database directly, so it needs no running service.
func deadLetters(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	if len(args) == 0 {
		return errors.New("dead-letters: want a subcommand: list or retry")
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("dead-letters "+sub, flag.ContinueOnError)
	fs.SetOutput(stdout)
	after := fs.Int64("after", 0, "list dead letters with an id greater than this")
	limit := fs.Int("limit", 100, "list at most this many")
	all := fs.Bool("all", false, "retry every dead letter")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("dead-letters %s: %w", sub, err)
	}

	pool, err := openDatabase(ctx, getenv)
	if err != nil {
		return err
	}
	defer pool.Close()
	admin := outbox.NewAdmin(pool)

	switch sub {
	case "list":
		dls, err := admin.DeadLetters(ctx, *after, *limit)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tAGGREGATE\tVERSION\tEVENT\tATTEMPTS\tDEAD SINCE\tLAST ERROR")
		for _, d := range dls {
			fmt.Fprintf(tw, "%d\t%s/%s\t%d\t%s\t%d\t%s\t%s\n", d.ID, d.AggregateType, d.AggregateID,
				d.AggregateVersion, d.EventType, d.Attempts, d.DeadLetteredAt.Format("2006-01-02T15:04:05Z07:00"), d.LastError)
		}
		return tw.Flush()
	case "retry":
		if *all {
			if fs.NArg() != 0 {
				return errors.New("dead-letters retry: give an id or -all, not both")
			}
			n, err := admin.RetryAll(ctx)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "retried %d dead letters\n", n)
			return nil
		}
		if fs.NArg() != 1 {
			return errors.New("dead-letters retry: want one id, or -all")
		}
		id, err := strconv.ParseInt(fs.Arg(0), 10, 64)
		if err != nil || id < 1 {
			return fmt.Errorf("dead-letters retry: %q is not a positive id", fs.Arg(0))
		}
		if err := admin.Retry(ctx, id); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "retried dead letter %d\n", id)
		return nil
	default:
		return fmt.Errorf("dead-letters: unknown subcommand %q: want list or retry", sub)
	}
}

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// deadLetters is the operator's CLI on the outbox's dead letters. It works on
// the database directly, so it needs no running service.
func deadLetters(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	if len(args) == 0 {
		return errors.New("dead-letters: want a subcommand: list, retry or discard")
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("dead-letters "+sub, flag.ContinueOnError)
	fs.SetOutput(stdout)
	after := fs.Int64("after", 0, "list dead letters with an id greater than this")
	limit := fs.Int("limit", 100, "list at most this many")
	all := fs.Bool("all", false, "retry every dead letter")
	reason := fs.String("reason", "", "why the dead letter is discarded (required by discard)")
	// Flags may come before or after the id: "discard 42 -reason ...".
	var ids []string
	for {
		if err := fs.Parse(args); err != nil {
			return fmt.Errorf("dead-letters %s: %w", sub, err)
		}
		if fs.NArg() == 0 {
			break
		}
		ids, args = append(ids, fs.Arg(0)), fs.Args()[1:]
	}
	if sub == "discard" {
		// Checked before the database is opened: a typo costs nothing.
		if len(ids) != 1 {
			return errors.New(`dead-letters discard: want one id: dead-letters discard ID -reason "..."`)
		}
		if strings.TrimSpace(*reason) == "" {
			return errors.New(`dead-letters discard: a reason is required: -reason "..."`)
		}
	}

	pool, err := openDatabase(ctx, getenv)
	if err != nil {
		return err
	}
	defer pool.Close()
	admin := outboxadmin.New(pool)

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
			if len(ids) != 0 {
				return errors.New("dead-letters retry: give an id or -all, not both")
			}
			n, err := admin.RetryAll(ctx)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "retried %d dead letters\n", n)
			return nil
		}
		if len(ids) != 1 {
			return errors.New("dead-letters retry: want one id, or -all")
		}
		id, err := parseID("retry", ids[0])
		if err != nil {
			return err
		}
		if err := admin.Retry(ctx, id); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "retried dead letter %d\n", id)
		return nil
	case "discard":
		id, err := parseID("discard", ids[0])
		if err != nil {
			return err
		}
		if err := admin.Discard(ctx, id, *reason); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "discarded dead letter %d\n", id)
		return nil
	default:
		return fmt.Errorf("dead-letters: unknown subcommand %q: want list, retry or discard", sub)
	}
}

func parseID(sub, s string) (int64, error) {
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id < 1 {
		return 0, fmt.Errorf("dead-letters %s: %q is not a positive id", sub, s)
	}
	return id, nil
}

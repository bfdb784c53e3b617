package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// deadLetterDB returns the environment of a migrated database whose outbox
// holds a dead letter (order o-1's first event), the event queued behind it,
// and a pending event of another order.
func deadLetterDB(t *testing.T) (env map[string]string, pool *pgxpool.Pool, dead, behind, pending int64) {
	t.Helper()
	ctx := context.Background()
	env = map[string]string{"DATABASE_URL": newDatabaseURL(t)}
	if err := run(ctx, []string{"migrate"}, func(k string) string { return env[k] }, io.Discard, io.Discard); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	pool, err := pgxpool.New(ctx, env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var got []outbox.Enqueued
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		m := func(id, event string) outbox.Message {
			return outbox.Message{AggregateType: "order", AggregateID: id, EventType: event, Payload: []byte(`{}`)}
		}
		got, err = new(outbox.Writer).Enqueue(ctx, tx, m("o-1", "order.created"), m("o-1", "order.cancelled"), m("o-2", "order.created"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// What a relay does when an event reaches its MaxAttempts.
	if _, err := pool.Exec(ctx, `UPDATE outbox SET attempts = 10, last_error = 'returned by the broker: NO_ROUTE',
		dead_lettered_at = now() WHERE id = $1`, got[0].ID); err != nil {
		t.Fatal(err)
	}
	return env, pool, got[0].ID, got[1].ID, got[2].ID
}

func TestDeadLettersDiscardCLI(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env, pool, dead, behind, pending := deadLetterDB(t)
	cli := func(args ...string) (string, error) {
		var out bytes.Buffer
		err := run(ctx, append([]string{"dead-letters", "discard"}, args...), func(k string) string { return env[k] }, &out, io.Discard)
		return out.String(), err
	}
	state := func() string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT (SELECT json_agg(o ORDER BY id)::text FROM outbox o) ||
			(SELECT count(*)::text FROM outbox_discarded)`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}

	before := state()
	for _, tc := range []struct {
		args []string
		want string // in the error
	}{
		{[]string{strconv.FormatInt(dead, 10)}, "reason"},
		{[]string{strconv.FormatInt(dead, 10), "-reason", ""}, "reason"},
		{[]string{"-reason", "x"}, "want one id"},
		{[]string{"abc", "-reason", "x"}, "not a positive id"},
		{[]string{"1", "2", "-reason", "x"}, "want one id"},
		{[]string{strconv.FormatInt(pending, 10), "-reason", "x"}, "not dead-lettered"},
		{[]string{strconv.FormatInt(behind, 10), "-reason", "x"}, "not dead-lettered"},
		{[]string{"999999", "-reason", "x"}, "no event with this id"},
	} {
		if out, err := cli(tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("discard %q: %q, %v; want an error about %q", tc.args, out, err, tc.want)
		}
	}
	if after := state(); after != before {
		t.Fatalf("rejected discards changed the outbox:\nbefore %s\nafter  %s", before, after)
	}

	out, err := cli(strconv.FormatInt(dead, 10), "-reason", "consumers reject v1 of order o-1; replayed by hand")
	if err != nil {
		t.Fatalf("discard: %v", err)
	}
	if want := "discarded dead letter " + strconv.FormatInt(dead, 10) + "\n"; out != want {
		t.Fatalf("discard printed %q, want %q", out, want)
	}
	var reason string
	var blocked bool
	err = pool.QueryRow(ctx, `SELECT (SELECT reason FROM outbox_discarded WHERE id = $1), (SELECT blocked FROM outbox WHERE id = $2)`,
		dead, behind).Scan(&reason, &blocked)
	if err != nil || reason != "consumers reject v1 of order o-1; replayed by hand" || blocked {
		t.Fatalf("after discard: reason %q, next event blocked %v, %v", reason, blocked, err)
	}
	// The flag may come first, too; a second discard of the same id is an error.
	if _, err := cli("-reason", "again", strconv.FormatInt(dead, 10)); !errors.Is(err, outboxadmin.ErrNotFound) {
		t.Fatalf("second discard: %v, want ErrNotFound", err)
	}
}

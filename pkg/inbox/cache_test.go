package inbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/event"
	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"

	"github.com/outbox-inbox/reference/pkg/inbox"
	"github.com/outbox-inbox/reference/pkg/inbox/internal/inboxtest"
)

// monitoredDatabase returns a fresh database on a client of its own that
// counts every command sent to that database (heartbeats and handshakes are
// not commands, and go to no database of the test).
func monitoredDatabase(t *testing.T) (*mongo.Database, *atomic.Int64) {
	t.Helper()
	base := inboxtest.Database(t) // dropped at the end
	name := base.Name()
	ops := new(atomic.Int64)
	client, err := mongo.Connect(options.Client().ApplyURI(inboxtest.URI(t)).SetMonitor(&event.CommandMonitor{
		Started: func(_ context.Context, e *event.CommandStartedEvent) {
			if e.DatabaseName == name {
				ops.Add(1)
			}
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.WithoutCancel(t.Context())) })
	return client.Database(name), ops
}

// process calls Process and fails t unless it returns want.
func (b *bundle) process(t *testing.T, msgID string, want inbox.Result) {
	t.Helper()
	res, err := b.in.Process(t.Context(), msgID, b.apply(msgID))
	if err != nil || res != want {
		t.Fatalf("Process(%s): %v, %v; want %v", msgID, res, err, want)
	}
}

// noDatabaseOps fails t if f sends any command to the database.
func noDatabaseOps(t *testing.T, ops *atomic.Int64, what string, f func()) {
	t.Helper()
	before := ops.Load()
	f()
	if n := ops.Load() - before; n != 0 {
		t.Fatalf("%s sent %d commands to the database, want none (answered from the done cache)", what, n)
	}
}

// someDatabaseOps fails t unless f sends a command to the database.
func someDatabaseOps(t *testing.T, ops *atomic.Int64, what string, f func()) {
	t.Helper()
	before := ops.Load()
	f()
	if ops.Load() == before {
		t.Fatalf("%s sent no command to the database, want a lookup", what)
	}
}

func TestDoneCacheAnswersDuplicatesWithoutTheDatabase(t *testing.T) {
	t.Parallel()
	for _, v := range standaloneVariants {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			db, ops := monitoredDatabase(t)
			b := setup(t, db, v.cfg)
			b.process(t, "m-1", inbox.Processed)
			noDatabaseOps(t, ops, "a duplicate", func() { b.process(t, "m-1", inbox.Duplicate) })
			noDatabaseOps(t, ops, "IsDone", func() { b.mustBeDone(t, "m-1", true) })
			if n := b.runs.Load(); n != 1 {
				t.Fatalf("handler ran %d times, want once", n)
			}

			// Done is final: the cache stays right after the record was
			// purged, where the database alone would run the handler again.
			if n, err := b.in.Purge(t.Context(), time.Now().Add(8*24*time.Hour)); err != nil || n != 1 {
				t.Fatalf("Purge: %d, %v; want the record purged", n, err)
			}
			b.process(t, "m-1", inbox.Duplicate)
			if n := b.runs.Load(); n != 1 {
				t.Fatalf("handler ran %d times after the purge, want once", n)
			}
		})
	}
}

func TestDoneCacheIsBoundedAndEvictsTheOldest(t *testing.T) {
	t.Parallel()
	db, ops := monitoredDatabase(t)
	const size = 3
	b := setup(t, db, inbox.Config{DoneCacheSize: size})
	for i := range size + 1 { // m-0 is evicted by m-3
		b.process(t, fmt.Sprintf("m-%d", i), inbox.Processed)
	}
	for i := 1; i <= size; i++ {
		id := fmt.Sprintf("m-%d", i)
		noDatabaseOps(t, ops, "duplicate of cached "+id, func() { b.process(t, id, inbox.Duplicate) })
	}
	// The evicted id is looked up, found done, and cached again (evicting m-1).
	someDatabaseOps(t, ops, "duplicate of evicted m-0", func() { b.process(t, "m-0", inbox.Duplicate) })
	noDatabaseOps(t, ops, "second duplicate of m-0", func() { b.process(t, "m-0", inbox.Duplicate) })
	someDatabaseOps(t, ops, "duplicate of m-1, evicted by m-0", func() { b.process(t, "m-1", inbox.Duplicate) })
	if n := b.runs.Load(); n != size+1 {
		t.Fatalf("handler ran %d times, want once per message (%d)", n, size+1)
	}
}

func TestDoneCacheCanBeDisabled(t *testing.T) {
	t.Parallel()
	db, ops := monitoredDatabase(t)
	b := setup(t, db, inbox.Config{DoneCacheSize: -1})
	b.process(t, "m-1", inbox.Processed)
	for range 2 {
		someDatabaseOps(t, ops, "a duplicate without the cache", func() { b.process(t, "m-1", inbox.Duplicate) })
	}
	if n := b.runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want once", n)
	}
}

package outboxwal

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

func TestSnapshotSaysWhichTransactionsCommitted(t *testing.T) {
	// Epoch 3 (3 << 32 = 12884901888): xmin 3:12, xmax 3:22; 3:12, 3:15 and 3:19
	// running.
	s, err := parseSnapshot("12884901900:12884901910:12884901900,12884901903,12884901907")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		xid  uint32
		want bool
	}{
		{6, true},          // below xmin
		{12, false},        // xmin: the oldest still running (xmin 3:12)
		{13, true},         // between, not running
		{15, false},        // running
		{19, false},        // running
		{22, false},        // xmax itself
		{4294967000, true}, // the previous epoch's, long finished
	} {
		if got := s.committed(c.xid); got != c.want {
			t.Errorf("xid %d (full %d): committed %v, want %v", c.xid, s.full(c.xid), got, c.want)
		}
	}
	if _, err := parseSnapshot("1:2"); err == nil {
		t.Error("a snapshot without xip parsed")
	}
	if s, err := parseSnapshot("5:9:"); err != nil || len(s.xip) != 0 || !s.committed(7) {
		t.Errorf("empty xip: %+v %v", s, err)
	}
}

// A transaction is not visible until it ended, and notVisible says so on the
// server the session streams from only.
func TestNotVisibleUntilTheTransactionEnds(t *testing.T) {
	ctx := context.Background()
	pool := outboxtest.Pool(t)
	var server string
	if err := pool.QueryRow(ctx, "SELECT "+serverSQL).Scan(&server); err != nil {
		t.Fatal(err)
	}
	f := fence{server: server}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	var xid uint32
	if err := tx.QueryRow(ctx, "SELECT txid_current()::bigint % 4294967296").Scan(&xid); err != nil {
		t.Fatal(err)
	}
	open := &event{tx: &txn{xid: xid, commitTime: time.Now()}}
	// A transaction that has ended for sure: one of this test's own (an xid
	// a little below the open one may belong to another test, still open).
	var old uint32
	if err := pool.QueryRow(ctx, "SELECT txid_current()::bigint % 4294967296").Scan(&old); err != nil {
		t.Fatal(err)
	}
	done := &event{tx: &txn{xid: old}}
	hidden, err := notVisible(ctx, pool, f, []*event{open, done, open})
	if err != nil {
		t.Fatal(err)
	}
	if len(hidden) != 2 || hidden[0] != open || !done.tx.visible.Load() {
		t.Fatalf("while open: hidden %v, want only the open transaction's events", hidden)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	hidden, err = notVisible(ctx, pool, f, []*event{open})
	if err != nil || len(hidden) != 0 || !open.tx.visible.Load() {
		t.Fatalf("after commit: hidden %v, %v", hidden, err)
	}
	if _, err := notVisible(ctx, pool, fence{server: "1/1"}, []*event{{tx: &txn{xid: xid + 1}}}); !errors.Is(err, errFenced) {
		t.Fatalf("on another server: %v, want errFenced", err)
	}
}

// BenchmarkVisibilityCheck compares what the relay asks PostgreSQL before a
// batch (one snapshot) with the pg_locks scan it replaced, while 50 other
// sessions are in transactions holding a few locks each (a busy server).
// go test -run '^$' -bench VisibilityCheck ./pkg/outbox/outboxwal/
func BenchmarkVisibilityCheck(b *testing.B) {
	ctx := context.Background()
	pool := outboxtest.Pool(b)
	for i := range 50 {
		conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = conn.Close(context.Background()) })
		tx, err := conn.Begin(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT txid_current(); LOCK TABLE outbox IN ACCESS SHARE MODE; SELECT count(*) FROM outbox_aggregates"); err != nil {
			b.Fatal(err, i)
		}
	}
	xids := []string{"1", "2", "3", "4", "5", "6", "7", "8"}
	b.Run("snapshot", func(b *testing.B) {
		for b.Loop() {
			var text, server string
			if err := pool.QueryRow(ctx, snapshotSQL).Scan(&text, &server); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("pg_locks", func(b *testing.B) {
		for b.Loop() {
			rows, err := pool.Query(ctx, `SELECT DISTINCT transactionid::text FROM pg_locks
WHERE locktype = 'transactionid' AND transactionid::text = ANY($1::text[])`, xids)
			if err != nil {
				b.Fatal(err)
			}
			rows.Close()
		}
	})
}

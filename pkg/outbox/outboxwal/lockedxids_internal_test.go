package outboxwal

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// lockedXids says a transaction is still committing (not visible to new
// snapshots) until it ended: the barrier the sweep and the check rely on,
// because the stream can deliver a transaction before it is visible.
func TestLockedXidsSeesTransactionsUntilTheyEnd(t *testing.T) {
	ctx := context.Background()
	pool := outboxtest.Pool(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	var xid uint32
	if err := tx.QueryRow(ctx, "SELECT txid_current()::bigint % 4294967296").Scan(&xid); err != nil {
		t.Fatal(err)
	}
	ev := &event{tx: &txn{xid: xid, commitTime: time.Now()}}
	other := &event{tx: &txn{xid: xid + 1000000}}
	locked, err := lockedXids(ctx, pool, []*event{ev, other, ev})
	if err != nil {
		t.Fatal(err)
	}
	if !locked[xid] || locked[xid+1000000] || len(locked) != 1 {
		t.Fatalf("while open: locked %v, want only %d", locked, xid)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	locked, err = lockedXids(ctx, pool, []*event{ev})
	if err != nil {
		t.Fatal(err)
	}
	if len(locked) != 0 {
		t.Fatalf("after commit: locked %v, want none", locked)
	}
}

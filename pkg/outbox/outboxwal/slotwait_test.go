package outboxwal_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// Creating a logical slot waits for every transaction then running on the
// server, in any database, to end. A transaction open longer than the
// relay's per-statement deadline (10 s) must delay Prepare, not fail it.
func TestPrepareOutwaitsALongTransactionOfAnotherDatabase(t *testing.T) {
	if testing.Short() {
		t.Skip("holds a transaction open for 12 s")
	}
	ctx := context.Background()
	pool := walPool(t)
	cfg := walConfig(t, pool)
	other := walPool(t) // a database of its own: the wait is server-wide
	tx, err := other.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT txid_current()"); err != nil { // an xid: the slot waits for it
		_ = tx.Rollback(ctx)
		t.Fatal(err)
	}
	const hold = 12 * time.Second
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		time.Sleep(hold)
		_ = tx.Rollback(context.Background())
	}()
	defer func() { <-ended }()
	relay, err := outboxwal.NewRelay(pool, &gatePublisher{allowed: map[int64]bool{}}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := relay.Prepare(ctx); err != nil {
		t.Fatalf("Prepare with a transaction open %v on the server: %v", hold, err)
	}
	if took := time.Since(start); took < hold-time.Second {
		t.Fatalf("Prepare returned after %v, before the transaction it must wait for ended (%v)", took, hold)
	}
}

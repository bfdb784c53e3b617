package outboxwal

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// A relay whose host lost the network in the middle of a write leaves its
// transaction open, holding the slot's row, until TCP gives up on the
// connection (hours). The relay taking over must say which backend blocks
// it rather than time out blind, and the stalled session must not last:
// the server ends a relay's session idle in a transaction after
// idleInTransactionTimeout, and the takeover goes through.
func TestTakeoverIsNotBlockedForLongByAStalledSession(t *testing.T) {
	ctx := context.Background()
	pool, server := slotsPool(t)
	const slot = "stalled_session"
	old, err := takeSlot(ctx, pool, slot, server)
	if err != nil {
		t.Fatal(err)
	}
	stalled := make(chan int32, 1)
	release := make(chan struct{})
	ended := make(chan error, 1)
	go func() {
		ended <- fencedTx(ctx, pool, fence{slot: slot, epoch: old.epoch, server: server}, func(tx pgx.Tx) error {
			var pid int32
			if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				return err
			}
			stalled <- pid
			<-release // the host is gone: nothing more is sent
			return nil
		})
	}()
	defer close(release)
	pid := <-stalled

	tctx, cancel := context.WithTimeout(ctx, dbTimeout)
	_, err = takeSlot(tctx, pool, slot, server)
	cancel()
	if err == nil || !strings.Contains(err.Error(), "backend pid "+strconv.Itoa(int(pid))) {
		t.Fatalf("takeover while a stalled session holds the row: %v, want an error naming backend pid %d", err, pid)
	}
	outboxtest.WaitFor(t, "the takeover, once the server ended the stalled session", 60*time.Second, func() (bool, error) {
		tctx, cancel := context.WithTimeout(ctx, dbTimeout)
		defer cancel()
		_, err := takeSlot(tctx, pool, slot, server)
		return err == nil, nil
	})
}

//go:build mutant_orders_ackfirst

package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// mutantOrdersAckFirst plants a bug for make chaos-mutants (e2e/chaos.Mutants):
// Create returns the new order before its transaction commits, so the API
// answers 201 for a transaction that may still roll back (a crash, a killed
// session, a restart of PostgreSQL before the commit). Only a build with
// -tags mutant_orders_ackfirst has it; see mutant_orders_ackfirst_off.go.
const mutantOrdersAckFirst = true

// mutantCommitDelay is how long the planted bug leaves a transaction
// uncommitted after Create returned.
const mutantCommitDelay = 200 * time.Millisecond

// commitLater runs fn in a transaction and returns once fn did, leaving the
// commit to a goroutine mutantCommitDelay later.
func (s *Store) commitLater(ctx context.Context, fn func(pgx.Tx) error) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	go func() {
		ctx := context.WithoutCancel(ctx)
		time.Sleep(mutantCommitDelay)
		if err := tx.Commit(ctx); err != nil {
			_ = tx.Rollback(ctx)
		}
	}()
	return nil
}

//go:build !mutant_orders_ackfirst

package postgres

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
)

// mutantOrdersAckFirst is the planted bug of make chaos-mutants built with
// -tags mutant_orders_ackfirst (mutant_orders_ackfirst.go): off in every
// other build, where the code it guards is dead and the compiler drops it.
const mutantOrdersAckFirst = false

// commitLater is the planted bug's commit; never called in this build.
func (s *Store) commitLater(context.Context, func(pgx.Tx) error) error {
	return errors.New("postgres: commitLater belongs to the mutant_orders_ackfirst build only")
}

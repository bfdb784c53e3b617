//go:build mutant_wal_ackpast

package outboxwal

// mutantWALAckPast plants a bug for make chaos-mutants (e2e/chaos.Mutants):
// the WAL relay acknowledges the slot past every sealed transaction, its
// unconfirmed events included. Only a build with -tags mutant_wal_ackpast has
// it; see mutant_wal_ackpast_off.go.
const mutantWALAckPast = true

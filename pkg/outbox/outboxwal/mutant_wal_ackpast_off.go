//go:build !mutant_wal_ackpast

package outboxwal

// mutantWALAckPast is the planted bug of make chaos-mutants built with -tags
// mutant_wal_ackpast (mutant_wal_ackpast.go): off in every other build, where
// the code it guards is dead and the compiler drops it.
const mutantWALAckPast = false

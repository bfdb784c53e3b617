//go:build !mutant_relay_reorder

package outbox

// mutantRelayReorder is the planted bug of make chaos-mutants built with -tags
// mutant_relay_reorder (mutant_relay_reorder.go): off in every other build,
// where the code it guards is dead and the compiler drops it.
const mutantRelayReorder = false

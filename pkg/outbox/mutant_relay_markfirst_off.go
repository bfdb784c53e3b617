//go:build !mutant_relay_markfirst

package outbox

// mutantRelayMarkFirst is the planted bug of make chaos-mutants built with
// -tags mutant_relay_markfirst (mutant_relay_markfirst.go): off in every other
// build, where the code it guards is dead and the compiler drops it.
const mutantRelayMarkFirst = false

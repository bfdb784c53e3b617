//go:build mutant_relay_reorder

package outbox

// mutantRelayReorder plants a bug for make chaos-mutants (e2e/chaos.Mutants):
// the polling relay publishes each claimed batch in reverse, so the runs of an
// aggregate go out newest first. Only a build with -tags mutant_relay_reorder
// has it; see mutant_relay_reorder_off.go.
const mutantRelayReorder = true

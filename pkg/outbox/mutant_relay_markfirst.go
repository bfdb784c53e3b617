//go:build mutant_relay_markfirst

package outbox

// mutantRelayMarkFirst plants a bug for make chaos-mutants
// (e2e/chaos.Mutants): the polling relay marks a batch published before it
// publishes it, and ignores what the broker says of each message. Only a
// build with -tags mutant_relay_markfirst has it; see
// mutant_relay_markfirst_off.go.
const mutantRelayMarkFirst = true

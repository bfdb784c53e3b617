//go:build mutant_inbox_nodedup

package inbox

// mutantInboxNoDedup plants a bug for make chaos-mutants (e2e/chaos.Mutants):
// the inbox deduplicates nothing: IsDone is always false (the check of the
// standalone mode, the one FerretDB gets) and the done cache is never
// consulted, and the version gate (Gate) does not look at the version a
// message already holds, so every redelivery runs the handler again. Only a build with
// -tags mutant_inbox_nodedup has it; see mutant_inbox_nodedup_off.go.
const mutantInboxNoDedup = true

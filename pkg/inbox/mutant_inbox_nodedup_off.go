//go:build !mutant_inbox_nodedup

package inbox

// mutantInboxNoDedup is the planted bug of make chaos-mutants built with -tags
// mutant_inbox_nodedup (mutant_inbox_nodedup.go): off in every other build,
// where the code it guards is dead and the compiler drops it.
const mutantInboxNoDedup = false

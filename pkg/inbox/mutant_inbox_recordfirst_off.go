//go:build !mutant_inbox_recordfirst

package inbox

// mutantInboxRecordFirst is the planted bug of make chaos-mutants built with
// -tags mutant_inbox_recordfirst (mutant_inbox_recordfirst.go): off in every
// other build, where the code it guards is dead and the compiler drops it.
const mutantInboxRecordFirst = false

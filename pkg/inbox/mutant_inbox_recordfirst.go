//go:build mutant_inbox_recordfirst

package inbox

// mutantInboxRecordFirst plants a bug for make chaos-mutants
// (e2e/chaos.Mutants): the standalone inbox records a message done before its
// handler runs, so a handler that fails or dies after the record loses the
// effect. Only a build with -tags mutant_inbox_recordfirst has it; see
// mutant_inbox_recordfirst_off.go.
const mutantInboxRecordFirst = true

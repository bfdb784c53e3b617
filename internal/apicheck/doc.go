// Package apicheck holds the listing of the exported API of pkg/outbox and
// pkg/inbox (and of their subpackages) in testdata, and the test that keeps
// it true: a name added, removed or changed in those packages fails
// TestExportedAPIIsTheListedOne until the listing is regenerated with
//
//	go test ./internal/apicheck -update
//
// so each growth of the public surface shows up in review as a diff of
// testdata/*.api.
package apicheck

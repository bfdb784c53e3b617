// Package copycheck holds a test, and nothing else: that pkg/outbox and
// pkg/inbox, copied with their tests into a module of their own, build, vet
// and run their examples there, without anything else of this repository.
// People copy these packages; this keeps that possible.
package copycheck

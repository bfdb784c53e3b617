// Package copycheck holds tests, and nothing else: that pkg/outbox and
// pkg/inbox, each copied with its subpackages and tests into a module of its
// own, tidy, vet (their tests included) and run their examples there without
// anything else of this repository, and that what the copy adds to its
// go.mod is small and named, module by module, in the package's doc.go (no
// server, container library or embedded database). People copy these
// packages; this keeps that possible.
package copycheck

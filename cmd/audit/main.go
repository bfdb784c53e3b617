// Command audit proves the flow whole from the stores themselves: it compares
// the events the orders service's outbox committed with the messages the
// shipping service's inbox recorded as applied, for a window of creation
// times, and prints a JSON report (package internal/audit says what each
// bucket means).
//
//	go run ./cmd/audit                     one audit; exit 1 when an event is missing or an inbox record is a phantom
//	go run ./cmd/audit -every 1m           audit every minute and serve the counts as Prometheus gauges on -metrics-addr
//	                                       (incrementally: a full audit first and every -full-every, 6h; the
//	                                       cycles between read only new events and those not applied yet)
//	make audit                             one audit of the demo's databases
//
// Environment (defaults: this machine's local services, as the services use
// them):
//
//	DATABASE_URL      postgres://postgres@127.0.0.1:5432/orders?sslmode=disable   (the orders database)
//	MONGO_URI         mongodb://127.0.0.1:27017   (the path is shipping's database, default "shipping")
//	OUTBOX_RETENTION  168h: how long the relays keep published rows (the orders service's setting)
//	LOG_LEVEL         info, in -every mode (logs go to stdout as JSON lines)
//
// The default window is the outbox's retention, less a grace period at each
// end: -since is now - OUTBOX_RETENTION + -grace (published rows older than
// that are being purged, and their inbox records would look like phantoms),
// -until is now - -grace (younger events may still be in flight). -since and
// -until take a time (RFC 3339) or a duration before now ("24h"). The grace
// defaults to shipping's -max-deferral-age (30m) + 15m: a message shipping
// still defers is on its way, not missing. See docs/audit.md.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout)
	switch {
	case errors.Is(err, errNotWhole):
		fmt.Fprintln(os.Stderr, "audit:", err)
		os.Exit(1)
	case err != nil:
		fmt.Fprintln(os.Stderr, "audit:", err)
		os.Exit(2)
	}
}

package outbox_test

import (
	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
)

// The helpers every test of the package uses, shared with outboxamqp's tests.
// Each test works in a schema of its own, dropped in cleanup, so tests run in
// parallel.
var (
	testDatabaseURL = outboxtest.DatabaseURL
	newSchemaPool   = outboxtest.SchemaPool // fresh schema, no outbox tables
	newTestPool     = outboxtest.Pool       // fresh schema, outbox tables migrated
	msg             = outboxtest.Msg
	enqueue         = outboxtest.Enqueue
	waitFor         = outboxtest.WaitFor
	outboxEmpty     = outboxtest.OutboxEmpty
	startRelay      = outboxtest.StartRelay
	claimArgs       = outbox.ClaimArgs
)

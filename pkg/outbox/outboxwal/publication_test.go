package outboxwal_test

import (
	"context"
	"strings"
	"testing"

	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// A publication of the outbox made beforehand that would not stream every
// insert whole is refused, with an error naming it and what is wrong. They
// used to be accepted: the relay reported itself streaming and published
// nothing (or would decode rows with columns missing).
func TestPublicationThatHidesInsertsIsRefused(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct{ name, with, want string }{
		{"no inserts", `FOR TABLE outbox WITH (publish = 'update, delete')`, "does not publish inserts"},
		{"row filter", `FOR TABLE outbox WHERE (aggregate_type <> 'order')`, "row filter"},
		{"column list", `FOR TABLE outbox (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload)`, "column list"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := walPool(t)
			cfg := walConfig(t, pool)
			if _, err := pool.Exec(ctx, `CREATE PUBLICATION `+cfg.Publication+` `+tc.with); err != nil {
				t.Fatal(err)
			}
			relay, err := outboxwal.NewRelay(pool, outboxtest.NewRecorder(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = relay.Prepare(ctx)
			if err == nil || !strings.Contains(err.Error(), cfg.Publication) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Prepare: %v, want an error naming %s and saying %q", err, cfg.Publication, tc.want)
			}
		})
	}
}

package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// CheckSchema tells a schema that is missing from one that an older Migrate
// created, and accepts what Migrate creates today.
func TestCheckSchema(t *testing.T) {
	t.Parallel()
	pool := newSchemaPool(t)
	ctx := context.Background()

	err := outbox.CheckSchema(ctx, pool)
	if !errors.Is(err, outbox.ErrSchemaMissing) || !strings.Contains(err.Error(), "Migrate") {
		t.Fatalf("empty schema: %v, want ErrSchemaMissing telling to run Migrate", err)
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		t.Fatalf("after Migrate: %v", err)
	}

	for marker, wantErr := range map[string]error{
		"NULL":                      outbox.ErrSchemaOutdated, // migrated before the marker existed
		"'pkg/outbox schema 1'":     outbox.ErrSchemaOutdated,
		"'someone else''s comment'": outbox.ErrSchemaOutdated,
		"'pkg/outbox schema two'":   outbox.ErrSchemaOutdated,
		fmt.Sprintf("'pkg/outbox schema %d'", outbox.SchemaVersion+1): nil, // a later Migrate keeps what this one needs
	} {
		if _, err := pool.Exec(ctx, "COMMENT ON TABLE outbox IS "+marker); err != nil {
			t.Fatal(err)
		}
		err := outbox.CheckSchema(ctx, pool)
		if !errors.Is(err, wantErr) || (wantErr != nil && !strings.Contains(err.Error(), "Migrate")) {
			t.Errorf("marker %s: CheckSchema = %v, want %v telling to run Migrate", marker, err, wantErr)
		}
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := outbox.CheckSchema(ctx, pool); err != nil {
		t.Fatalf("after migrating an outdated schema: %v", err)
	}
}

// CheckSchema reads the catalog only: it answers while another transaction
// holds the strongest lock on the outbox table, so it can never queue writers
// behind it, as DDL does.
func TestCheckSchemaTakesNoLockOnTheTable(t *testing.T) {
	t.Parallel()
	pool := newTestPool(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // test cleanup
	if _, err := tx.Exec(ctx, "LOCK TABLE outbox, outbox_aggregates, outbox_published IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	// A hang, not a slow answer, is the failure: the bound only ends the test.
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := outbox.CheckSchema(cctx, pool); err != nil {
		t.Fatalf("CheckSchema with the tables locked: %v", err)
	}
}

// The version marker is the schema's last statement, and names SchemaVersion:
// whoever changes the schema above it bumps both.
func TestSchemaEndsWithItsVersionMarker(t *testing.T) {
	t.Parallel()
	want := fmt.Sprintf("COMMENT ON TABLE outbox IS 'pkg/outbox schema %d';", outbox.SchemaVersion)
	if !strings.HasSuffix(strings.TrimSpace(outbox.Schema), want) {
		t.Fatalf("schema.sql does not end with %q", want)
	}
}

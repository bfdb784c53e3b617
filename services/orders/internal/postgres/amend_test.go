package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/order"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

// amendKey is the Idempotency of an amendment with key and note, as the API
// builds it (the hash stands in for the request's).
func amendKey(key, note string) order.Idempotency {
	return order.Idempotency{Key: key, RequestHash: []byte("hash:" + note)}
}

// outboxChain returns the order's outbox events in version order, each as
// "vN type note".
func outboxChain(t *testing.T, pool *pgxpool.Pool, orderID string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT aggregate_version, event_type, coalesce(payload->>'note', '') FROM outbox WHERE aggregate_id = $1
		ORDER BY aggregate_version`, orderID)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for rows.Next() {
		var (
			v        int64
			typ, not string
		)
		if err := rows.Scan(&v, &typ, &not); err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("v%d %s %s", v, typ, not))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Each amendment is the order's next version: the row (version, note) and
// its order.amended event commit together, for chains of any length.
func TestAmendmentsMakeTheNextVersions(t *testing.T) {
	t.Parallel()
	pool, store, o := storeWithOrder(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(uint64(len(t.Name())), 7))
	n := 4 + rng.IntN(16) // 5 to 20 versions
	want := []string{"v1 order.created "}
	for i := range n {
		note := fmt.Sprintf("note %d: leave at door %d", i, rng.IntN(1000))
		a, replayed, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: note}, amendKey(fmt.Sprintf("a-%d", i), note), nil)
		if err != nil || replayed {
			t.Fatalf("amendment %d: %v replayed=%v", i, err, replayed)
		}
		if a.OrderID != o.ID || a.Version != int64(i+2) || a.Note != note || a.AmendedAt.IsZero() {
			t.Fatalf("amendment %d = %+v, want v%d of %s with note %q", i, a, i+2, o.ID, note)
		}
		want = append(want, fmt.Sprintf("v%d order.amended %s", i+2, note))
	}
	got, err := store.Get(ctx, o.ID)
	if err != nil || got.Version != int64(n+1) || got.Note != want[n][len(fmt.Sprintf("v%d order.amended ", n+1)):] || got.Status != order.StatusCreated {
		t.Fatalf("order after %d amendments: %+v, %v", n, got, err)
	}
	if chain := outboxChain(t, pool, o.ID); fmt.Sprint(chain) != fmt.Sprint(want) {
		t.Fatalf("outbox chain:\n got %q\nwant %q", chain, want)
	}
	if _, changed, err := store.Cancel(ctx, o.ID, nil); err != nil || !changed {
		t.Fatalf("cancel after the amendments: changed=%v %v", changed, err)
	}
	if chain := outboxChain(t, pool, o.ID); len(chain) != n+2 || chain[n+1] != fmt.Sprintf("v%d order.cancelled ", n+2) {
		t.Fatalf("after the cancel: %q", chain)
	}
}

// A retry with the amendment's key gets the version the first attempt made,
// even after later amendments or a cancel; the key with another note is
// refused; a new amendment of a cancelled order is refused and writes
// nothing.
func TestAmendIsIdempotentByKeyAndRefusedOnACancelledOrder(t *testing.T) {
	t.Parallel()
	pool, store, o := storeWithOrder(t)
	ctx := context.Background()
	first, _, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "ring twice"}, amendKey("k1", "ring twice"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "back door"}, amendKey("k2", "back door"), nil); err != nil {
		t.Fatal(err)
	}
	again, replayed, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "ring twice"}, amendKey("k1", "ring twice"), nil)
	if err != nil || !replayed || again != first {
		t.Fatalf("retry of k1 = %+v replayed=%v %v; want %+v replayed", again, replayed, err, first)
	}
	if _, _, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "other"}, amendKey("k1", "other"), nil); !errors.Is(err, order.ErrIdempotencyKeyReused) {
		t.Fatalf("k1 with another note: %v, want ErrIdempotencyKeyReused", err)
	}
	if _, _, err := store.Cancel(ctx, o.ID, nil); err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "too late"}, amendKey("k3", "too late"), nil); !errors.Is(err, order.ErrCancelled) {
		t.Fatalf("amendment of a cancelled order: %v, want ErrCancelled", err)
	}
	if again, replayed, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "ring twice"}, amendKey("k1", "ring twice"), nil); err != nil || !replayed || again != first {
		t.Fatalf("retry of k1 after the cancel = %+v replayed=%v %v; want %+v replayed", again, replayed, err, first)
	}
	// A key names an amendment of one order: the same key on another order
	// is another amendment.
	p, _, err := store.Create(ctx, newOrder(), order.Idempotency{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if a, replayed, err := store.Amend(ctx, p.ID, order.NewAmendment{Note: "ring twice"}, amendKey("k1", "ring twice"), nil); err != nil || replayed || a.Version != 2 {
		t.Fatalf("k1 on another order = %+v replayed=%v %v; want its v2", a, replayed, err)
	}
	want := []string{"v1 order.created ", "v2 order.amended ring twice", "v3 order.amended back door", "v4 order.cancelled "}
	if chain := outboxChain(t, pool, o.ID); fmt.Sprint(chain) != fmt.Sprint(want) {
		t.Fatalf("outbox chain:\n got %q\nwant %q", chain, want)
	}
	if _, _, err := store.Amend(ctx, "6f1f2c55-7d53-4b8a-9a39-0d5c8e2f0c11", order.NewAmendment{Note: "x"}, amendKey("k9", "x"), nil); !errors.Is(err, order.ErrNotFound) {
		t.Fatalf("amendment of no order: %v, want ErrNotFound", err)
	}
	if _, _, err := store.Amend(ctx, p.ID, order.NewAmendment{Note: "x"}, order.Idempotency{}, nil); err == nil {
		t.Fatal("amendment without a key accepted")
	}
}

// Concurrent amendments of one order each make one version, without gaps;
// concurrent retries with one key make one between them.
func TestConcurrentAmendmentsMakeOneVersionEach(t *testing.T) {
	t.Parallel()
	pool, store, o := storeWithOrder(t)
	ctx := context.Background()
	const distinct, copies = 6, 4
	versions := make([]int64, distinct*copies)
	errs := make([]error, len(versions))
	var wg sync.WaitGroup
	for i := range versions {
		wg.Go(func() {
			note := fmt.Sprintf("note %d", i%distinct)
			a, _, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: note}, amendKey(fmt.Sprintf("k%d", i%distinct), note), nil)
			versions[i], errs[i] = a.Version, err
		})
	}
	wg.Wait()
	seen := make(map[int64]int)
	for i := range versions {
		if errs[i] != nil {
			t.Fatalf("amendment %d: %v", i, errs[i])
		}
		if versions[i] != versions[i%distinct] {
			t.Errorf("copies of key k%d got versions %d and %d", i%distinct, versions[i%distinct], versions[i])
		}
		seen[versions[i]]++
	}
	for v := int64(2); v <= distinct+1; v++ {
		if seen[v] != copies {
			t.Errorf("version %d answered %d times, want %d (the copies of one key)", v, seen[v], copies)
		}
	}
	if chain := outboxChain(t, pool, o.ID); len(chain) != distinct+1 {
		t.Fatalf("outbox chain %q, want %d events", chain, distinct+1)
	}
}

// A failure before the commit leaves the order at its version, and writes
// neither the event nor the amendment's key: a retry with the key then makes
// the version. A message the outbox refuses does the same.
func TestFailedAmendWritesNothing(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	ok := postgres.NewStore(pool, postgres.StoreConfig{})
	injected := errors.New("injected: crash before commit")
	failing := postgres.NewStore(pool, postgres.StoreConfig{BeforeCommit: func(context.Context, pgx.Tx) error { return injected }})
	ctx := context.Background()
	o, _, err := ok.Create(ctx, newOrder(), order.Idempotency{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := order.NewAmendment{Note: "gate code 1234"}
	if _, _, err := failing.Amend(ctx, o.ID, a, amendKey("k", a.Note), nil); !errors.Is(err, injected) {
		t.Fatalf("amend error = %v, want the injected one", err)
	}
	if _, _, err := ok.Amend(ctx, o.ID, a, amendKey("k", a.Note), badHeaders); !errors.Is(err, outbox.ErrInvalidMessage) {
		t.Fatalf("amend with a refused event: %v, want ErrInvalidMessage", err)
	}
	got, err := ok.Get(ctx, o.ID)
	if err != nil || got.Version != 1 || got.Note != "" || !got.UpdatedAt.Equal(o.UpdatedAt) {
		t.Fatalf("after the failed amendments: %+v, %v; want the order as created", got, err)
	}
	if e, k := pgtest.Count(t, pool, "outbox"), pgtest.Count(t, pool, "order_amendments"); e != 1 || k != 0 {
		t.Fatalf("outbox=%d order_amendments=%d, want 1 and 0", e, k)
	}
	am, replayed, err := ok.Amend(ctx, o.ID, a, amendKey("k", a.Note), nil)
	if err != nil || replayed || am.Version != 2 {
		t.Fatalf("retry after the failures = %+v replayed=%v %v; want v2, new", am, replayed, err)
	}
}

// Migrate gives an orders table of the schema before the amendments their
// note column (empty for the orders there), and a second Migrate does not
// wait for the transactions open on orders: it takes no lock on the table
// when the column is there.
func TestMigrateAddsTheNoteWithoutLockingOrdersOnceThere(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	store := postgres.NewStore(pool, postgres.StoreConfig{})
	o, _, err := store.Create(ctx, newOrder(), order.Idempotency{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `DROP TABLE order_amendments; ALTER TABLE orders DROP COLUMN note`); err != nil {
		t.Fatal(err)
	}
	if err := postgres.Migrate(ctx, pool, nil); err != nil {
		t.Fatalf("migrate the earlier schema: %v", err)
	}
	if got, err := store.Get(ctx, o.ID); err != nil || got.Note != "" {
		t.Fatalf("order of the earlier schema after migrating: %+v, %v", got, err)
	}
	if a, _, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "n"}, amendKey("k", "n"), nil); err != nil || a.Version != 2 {
		t.Fatalf("amend after migrating: %+v, %v", a, err)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT count(*) FROM orders`); err != nil { // ACCESS SHARE until the end
		t.Fatal(err)
	}
	mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := postgres.Migrate(mctx, pool, nil); err != nil {
		t.Fatalf("migrate beside an open transaction on orders: %v", err)
	}
}

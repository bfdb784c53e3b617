package postgres_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/services/orders/internal/order"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

// statement is one query a Store sent, with its arguments. batch tells the
// queries sent in a batch (one round trip for all) from the others.
type statement struct {
	sql   string
	args  []any
	batch bool
}

// recorder is a pgx tracer that keeps every query sent through the pool.
type recorder struct {
	mu   sync.Mutex
	seen []statement
}

func (r *recorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, statement{d.SQL, d.Args, false})
	return ctx
}

func (r *recorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *recorder) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (r *recorder) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, statement{d.SQL, d.Args, true})
}

func (r *recorder) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (r *recorder) take() []statement {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.seen
	r.seen = nil
	return s
}

// tracedPool returns a second pool on pool's schema whose queries rec records.
func tracedPool(t *testing.T, pool *pgxpool.Pool, rec *recorder) *pgxpool.Pool {
	t.Helper()
	cfg := pool.Config()
	cfg.ConnConfig.Tracer = rec
	traced, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(traced.Close)
	return traced
}

// Reading, amending or cancelling one order must not scan the orders table:
// every statement Get, Amend and Cancel send that touches orders finds the row through
// its primary key, so their cost stays flat as the table grows.
func TestGetAndCancelUseThePrimaryKey(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	ctx := context.Background()
	// Enough rows for the planner to prefer an index when the query lets it.
	if _, err := pool.Exec(ctx, `
		INSERT INTO orders (id, customer_id, currency, items, total, status)
		SELECT md5(i::text)::uuid, 'c-' || i, 'EUR', '[]', 100, 'created'
		FROM generate_series(1, 10000) AS i`); err != nil {
		t.Fatalf("seed orders: %v", err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE orders"); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	store := postgres.NewStore(tracedPool(t, pool, rec), postgres.StoreConfig{})
	o, _, err := store.Create(ctx, newOrder(), order.Idempotency{}, nil)
	if err != nil {
		t.Fatal(err)
	}

	for _, op := range []struct {
		name string
		run  func() error
	}{
		{"Get", func() error { _, err := store.Get(ctx, o.ID); return err }},
		{"Get of an upper-case id", func() error { _, err := store.Get(ctx, strings.ToUpper(o.ID)); return err }},
		{"Amend", func() error {
			_, _, err := store.Amend(ctx, o.ID, order.NewAmendment{Note: "n"}, order.Idempotency{Key: "k", RequestHash: []byte{1}}, nil)
			return err
		}},
		{"Cancel", func() error { _, _, err := store.Cancel(ctx, o.ID, nil); return err }},
	} {
		rec.take()
		if err := op.run(); err != nil {
			t.Errorf("%s: %v", op.name, err)
			continue
		}
		touched := 0
		for _, st := range rec.take() {
			if !strings.Contains(st.sql, "orders") || strings.Contains(st.sql, "idempotency_keys") {
				continue
			}
			touched++
			var plan []string
			rows, err := pool.Query(ctx, "EXPLAIN "+st.sql, st.args...)
			if err != nil {
				t.Fatalf("%s: explain %q: %v", op.name, st.sql, err)
			}
			for rows.Next() {
				var line string
				if err := rows.Scan(&line); err != nil {
					t.Fatal(err)
				}
				plan = append(plan, line)
			}
			if err := rows.Err(); err != nil {
				t.Fatalf("%s: explain %q: %v", op.name, st.sql, err)
			}
			text := strings.Join(plan, "\n")
			if strings.Contains(text, "Seq Scan on orders") || !strings.Contains(text, "orders_pkey") {
				t.Errorf("%s sends a statement that does not use orders' primary key:\n%s\nplan:\n%s", op.name, st.sql, text)
			}
		}
		if touched == 0 {
			t.Fatalf("%s sent no statement on orders", op.name)
		}
	}
	got, err := store.Get(ctx, strings.ToUpper(o.ID))
	if err != nil || got.ID != o.ID || got.Status != order.StatusCancelled {
		t.Fatalf("Get of the upper-case id = %+v, %v; want the cancelled order %s", got, err, o.ID)
	}
}

// An id that is not a UUID names no order: Get, Cancel and Amend answer ErrNotFound
// without asking the database.
func TestInvalidIDIsNotFoundWithoutAQuery(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	rec := &recorder{}
	store := postgres.NewStore(tracedPool(t, pool, rec), postgres.StoreConfig{})
	ctx := context.Background()
	for _, id := range []string{"", "42", "not-a-uuid", "6f1f2c55-7d53-4b8a-9a39-0d5c8e2f0c1", "6f1f2c55-7d53-4b8a-9a39-0d5c8e2f0c11x"} {
		if _, err := store.Get(ctx, id); !errors.Is(err, order.ErrNotFound) {
			t.Errorf("Get(%q) error = %v, want ErrNotFound", id, err)
		}
		if _, _, err := store.Cancel(ctx, id, nil); !errors.Is(err, order.ErrNotFound) {
			t.Errorf("Cancel(%q) error = %v, want ErrNotFound", id, err)
		}
		if _, _, err := store.Amend(ctx, id, order.NewAmendment{Note: "n"}, order.Idempotency{Key: "k"}, nil); !errors.Is(err, order.ErrNotFound) {
			t.Errorf("Amend(%q) error = %v, want ErrNotFound", id, err)
		}
	}
	if seen := rec.take(); len(seen) != 0 {
		t.Fatalf("invalid ids sent %d statements, first %q; want none", len(seen), seen[0].sql)
	}
}

// Create sends the generated InsertOrder and the outbox's insert in one
// batch: besides BEGIN and COMMIT, the order and its event cost one round
// trip (write_overhead in make bench measures what that saves).
func TestCreateSendsOrderAndEventInOneRoundTrip(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	rec := &recorder{}
	store := postgres.NewStore(tracedPool(t, pool, rec), postgres.StoreConfig{})
	if _, _, err := store.Create(context.Background(), newOrder(), order.Idempotency{}, nil); err != nil {
		t.Fatal(err)
	}
	var alone, batched []string
	for _, st := range rec.take() {
		if st.batch {
			batched = append(batched, st.sql)
		} else {
			alone = append(alone, strings.ToLower(st.sql))
		}
	}
	if len(alone) != 2 || alone[0] != "begin" || alone[1] != "commit" {
		t.Errorf("statements sent on their own: %q, want only begin and commit", alone)
	}
	if len(batched) < 2 || !strings.Contains(batched[0], "INSERT INTO orders") || !strings.Contains(batched[len(batched)-1], "INSERT INTO outbox ") {
		t.Errorf("batch: %q, want the order's insert then the outbox's statements", batched)
	}
}

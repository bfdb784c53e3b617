package postgres_test

import (
	"context"
	"errors"
	"reflect"
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

// storeWithOrder returns a store on a database of the test's own that holds
// one new order, o.
func storeWithOrder(t *testing.T) (*pgxpool.Pool, *postgres.Store, order.Order) {
	t.Helper()
	pool := pgtest.NewPool(t)
	store := postgres.NewStore(pool, postgres.StoreConfig{})
	o, _, err := store.Create(context.Background(), newOrder(), order.Idempotency{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return pool, store, o
}

func newOrder() order.NewOrder {
	return order.NewOrder{CustomerID: "c-42", Currency: "EUR", Items: []order.Item{{SKU: "sku-1", Quantity: 2, UnitPrice: 1250}}, Total: 2500}
}

func TestCreateWritesOrderAndEventTogether(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	store := postgres.NewStore(pool, postgres.StoreConfig{})
	ctx := context.Background()

	o, replayed, err := store.Create(ctx, newOrder(), order.Idempotency{}, map[string]string{"traceparent": "tp"})
	if err != nil || replayed {
		t.Fatalf("create: %v replayed=%v", err, replayed)
	}
	var aggID, eventType, payloadOrderID, tp string
	var version int64
	var total int64
	err = pool.QueryRow(ctx, `SELECT aggregate_id, event_type, aggregate_version, payload->>'order_id', (payload->>'total')::bigint, headers->>'traceparent' FROM outbox`).
		Scan(&aggID, &eventType, &version, &payloadOrderID, &total, &tp)
	if err != nil {
		t.Fatalf("read outbox: %v", err)
	}
	if aggID != o.ID || payloadOrderID != o.ID || eventType != order.EventCreated || version != 1 || total != 2500 || tp != "tp" {
		t.Fatalf("outbox row = %s %s v%d %s total %d tp %q", aggID, eventType, version, payloadOrderID, total, tp)
	}
	// The order returned is the order stored, and the event carries its instant.
	stored, err := store.Get(ctx, o.ID)
	if err != nil {
		t.Fatalf("get: %v", err)
	}
	stored.CreatedAt, stored.UpdatedAt = stored.CreatedAt.UTC(), stored.UpdatedAt.UTC()
	if !reflect.DeepEqual(stored, o) {
		t.Fatalf("stored order %+v, Create returned %+v", stored, o)
	}
	var eventCreatedAt time.Time
	if err := pool.QueryRow(ctx, `SELECT (payload->>'created_at')::timestamptz FROM outbox`).Scan(&eventCreatedAt); err != nil {
		t.Fatal(err)
	}
	if !eventCreatedAt.Equal(stored.CreatedAt) {
		t.Fatalf("event created_at %v, order created_at %v", eventCreatedAt, stored.CreatedAt)
	}
}

// A failure after the outbox insert and before the commit leaves neither the
// order nor its event.
func TestFailureBeforeCommitLeavesNeitherOrderNorEvent(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	injected := errors.New("injected: crash before commit")
	var calls int
	var rowsInTx []int
	store := postgres.NewStore(pool, postgres.StoreConfig{BeforeCommit: func(ctx context.Context, tx pgx.Tx) error {
		calls++
		// The outbox row is written at this point, inside the transaction.
		var n int
		if err := tx.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&n); err != nil {
			return err
		}
		rowsInTx = append(rowsInTx, n)
		return injected
	}})
	ctx := context.Background()

	if _, _, err := store.Create(ctx, newOrder(), order.Idempotency{Key: "k", RequestHash: []byte{1}}, nil); !errors.Is(err, injected) {
		t.Fatalf("create error = %v, want the injected one", err)
	}
	if calls != 1 || rowsInTx[0] != 1 {
		t.Fatalf("BeforeCommit ran %d times and saw %v outbox rows, want once with 1", calls, rowsInTx)
	}
	for _, table := range []string{"orders", "outbox", "idempotency_keys", "outbox_aggregates"} {
		if n := pgtest.Count(t, pool, table); n != 0 {
			t.Errorf("%s has %d rows after the failed transaction, want 0", table, n)
		}
	}

	// Same for a cancel: the order stays created and no event is written.
	ok := postgres.NewStore(pool, postgres.StoreConfig{})
	o, _, err := ok.Create(ctx, newOrder(), order.Idempotency{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := store.Cancel(ctx, o.ID, nil); !errors.Is(err, injected) {
		t.Fatalf("cancel error = %v, want the injected one", err)
	}
	got, err := ok.Get(ctx, o.ID)
	if err != nil || got.Status != order.StatusCreated || got.Version != 1 {
		t.Fatalf("after failed cancel: %+v, %v", got, err)
	}
	if n := pgtest.Count(t, pool, "outbox"); n != 1 || rowsInTx[1] != 2 {
		t.Fatalf("outbox has %d rows (%v inside the cancel), want only the create's", n, rowsInTx)
	}
}

func TestIdempotentCreate(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	store := postgres.NewStore(pool, postgres.StoreConfig{})
	ctx := context.Background()
	idem := order.Idempotency{Key: "retry-1", RequestHash: []byte("hash-a")}

	first, replayed, err := store.Create(ctx, newOrder(), idem, nil)
	if err != nil || replayed {
		t.Fatalf("first: %v %v", err, replayed)
	}
	again, replayed, err := store.Create(ctx, newOrder(), idem, nil)
	if err != nil || !replayed || again.ID != first.ID {
		t.Fatalf("retry: id %s (first %s) replayed=%v err=%v", again.ID, first.ID, replayed, err)
	}
	other := order.Idempotency{Key: "retry-1", RequestHash: []byte("hash-b")}
	if _, _, err := store.Create(ctx, newOrder(), other, nil); !errors.Is(err, order.ErrIdempotencyKeyReused) {
		t.Fatalf("reuse error = %v, want ErrIdempotencyKeyReused", err)
	}
	if o, e := pgtest.Count(t, pool, "orders"), pgtest.Count(t, pool, "outbox"); o != 1 || e != 1 {
		t.Fatalf("orders=%d outbox=%d, want 1 and 1", o, e)
	}
}

func TestConcurrentRetriesWithOneKeyCreateOneOrder(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	store := postgres.NewStore(pool, postgres.StoreConfig{})
	ctx := context.Background()
	idem := order.Idempotency{Key: "same", RequestHash: []byte("h")}

	const n = 10
	ids := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var o order.Order
			o, _, errs[i] = store.Create(ctx, newOrder(), idem, nil)
			ids[i] = o.ID
		}()
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		if ids[i] != ids[0] {
			t.Fatalf("request %d got order %s, request 0 got %s", i, ids[i], ids[0])
		}
	}
	if o, e := pgtest.Count(t, pool, "orders"), pgtest.Count(t, pool, "outbox"); o != 1 || e != 1 {
		t.Fatalf("orders=%d outbox=%d, want 1 and 1", o, e)
	}
}

func TestConcurrentCancelsEmitOneEvent(t *testing.T) {
	t.Parallel()
	pool, store, o := storeWithOrder(t)
	ctx := context.Background()

	const n = 8
	changed := make([]bool, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, changed[i], errs[i] = store.Cancel(ctx, o.ID, nil)
		}()
	}
	wg.Wait()
	winners := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("cancel %d: %v", i, errs[i])
		}
		if changed[i] {
			winners++
		}
	}
	if winners != 1 {
		t.Fatalf("%d cancels reported a change, want 1", winners)
	}
	rows, err := pool.Query(ctx, `SELECT event_type, aggregate_version FROM outbox WHERE aggregate_id = $1 ORDER BY aggregate_version`, o.ID)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var et string
		var v int64
		if err := rows.Scan(&et, &v); err != nil {
			t.Fatal(err)
		}
		got = append(got, et+"@"+string(rune('0'+v)))
	}
	if len(got) != 2 || got[0] != "order.created@1" || got[1] != "order.cancelled@2" {
		t.Fatalf("events = %v, want [order.created@1 order.cancelled@2]", got)
	}
	final, err := store.Get(ctx, o.ID)
	if err != nil || final.Status != order.StatusCancelled || final.Version != 2 {
		t.Fatalf("final order %+v, %v", final, err)
	}
}

func TestCancelUnknownOrder(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	store := postgres.NewStore(pool, postgres.StoreConfig{})
	_, _, err := store.Cancel(context.Background(), "6f1f2c55-7d53-4b8a-9a39-0d5c8e2f0c11", nil)
	if !errors.Is(err, order.ErrNotFound) {
		t.Fatalf("error = %v, want ErrNotFound", err)
	}
	if n := pgtest.Count(t, pool, "outbox"); n != 0 {
		t.Fatalf("outbox has %d rows", n)
	}
}

// badHeaders holds a header value the outbox refuses (invalid UTF-8), as a
// client's Tracestate could carry.
var badHeaders = map[string]string{"traceparent": "tp", "tracestate": "vendor=\xff\xfe"}

// A message the outbox rejects fails Create, and nothing is written: no order
// without its event, no idempotency key, no aggregate version.
func TestCreateWithARejectedEventWritesNothing(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	store := postgres.NewStore(pool, postgres.StoreConfig{})
	ctx := context.Background()

	for _, idem := range []order.Idempotency{{}, {Key: "k-1", RequestHash: []byte{1}}} {
		o, _, err := store.Create(ctx, newOrder(), idem, badHeaders)
		if !errors.Is(err, outbox.ErrInvalidMessage) {
			t.Errorf("create (idempotency key %q) error = %v (order %q), want ErrInvalidMessage", idem.Key, err, o.ID)
		}
	}
	for _, table := range []string{"orders", "outbox", "outbox_aggregates", "idempotency_keys"} {
		if n := pgtest.Count(t, pool, table); n != 0 {
			t.Errorf("%s has %d rows after creates whose event was rejected, want 0", table, n)
		}
	}
}

// A message the outbox rejects fails Cancel, and nothing changes: the order
// stays created at version 1 and no event is written.
func TestCancelWithARejectedEventWritesNothing(t *testing.T) {
	t.Parallel()
	pool, store, o := storeWithOrder(t)
	ctx := context.Background()

	if _, changed, err := store.Cancel(ctx, o.ID, badHeaders); !errors.Is(err, outbox.ErrInvalidMessage) || changed {
		t.Errorf("cancel error = %v changed=%v, want ErrInvalidMessage and no change", err, changed)
	}
	got, err := store.Get(ctx, o.ID)
	if err != nil || got.Status != order.StatusCreated || got.Version != 1 || !got.UpdatedAt.Equal(o.UpdatedAt) {
		t.Fatalf("after the rejected cancel: %+v, %v; want the order as created", got, err)
	}
	var events, version int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox), (SELECT version FROM outbox_aggregates WHERE aggregate_id = $1)`, o.ID).
		Scan(&events, &version); err != nil {
		t.Fatal(err)
	}
	if events != 1 || version != 1 {
		t.Fatalf("outbox has %d rows and the aggregate is at version %d, want only order.created at 1", events, version)
	}
}

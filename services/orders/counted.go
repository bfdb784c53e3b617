package main

import (
	"context"

	"github.com/outbox-inbox/reference/services/orders/internal/httpapi"
	"github.com/outbox-inbox/reference/services/orders/internal/metrics"
	"github.com/outbox-inbox/reference/services/orders/internal/order"
	"github.com/outbox-inbox/reference/services/orders/internal/postgres"
)

// The wiring plugs the adapters into the interfaces their consumers declare:
// the PostgreSQL store is the API's Orders.
var (
	_ httpapi.Orders = (*postgres.Store)(nil)
	_ httpapi.Orders = countedOrders{}
)

// countedOrders counts the orders the API creates and cancels
// (orders_created_total, orders_cancelled_total).
type countedOrders struct {
	httpapi.Orders
	m *metrics.Orders
}

func (c countedOrders) Create(ctx context.Context, n order.NewOrder, idem order.Idempotency, headers map[string]string) (order.Order, bool, error) {
	o, replayed, err := c.Orders.Create(ctx, n, idem, headers)
	if err == nil && !replayed {
		c.m.Created()
	}
	return o, replayed, err
}

func (c countedOrders) Cancel(ctx context.Context, id string, headers map[string]string) (order.Order, bool, error) {
	o, changed, err := c.Orders.Cancel(ctx, id, headers)
	if err == nil && changed {
		c.m.Cancelled()
	}
	return o, changed, err
}

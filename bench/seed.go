package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
)

// The names docs/events.md fixes.
const (
	exchange       = "orders.events"
	aggregateType  = "order"
	eventCreated   = "order.created"
	notifyChannel  = "outbox_orders"
	drainQueueName = "bench.drain"
)

// orderItem and createdPayload mirror the orders service's order.created
// event (docs/events.md), so messages have the size and shape of real ones.
type orderItem struct {
	SKU       string `json:"sku"`
	Quantity  int64  `json:"quantity"`
	UnitPrice int64  `json:"unit_price"`
}

type createdPayload struct {
	OrderID    string      `json:"order_id"`
	CustomerID string      `json:"customer_id"`
	Currency   string      `json:"currency"`
	Items      []orderItem `json:"items"`
	Total      int64       `json:"total"`
	CreatedAt  time.Time   `json:"created_at"`
}

var benchItems = []orderItem{{SKU: "sku-1", Quantity: 2, UnitPrice: 1250}}

// newUUID returns a random version 4 UUID in its text form.
func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// traceHeaders returns W3C trace context headers, as the orders API stores
// them from the request.
func traceHeaders() map[string]string {
	return map[string]string{"traceparent": "00-" + randomHex(16) + "-" + randomHex(8) + "-01"}
}

func createdEvent(orderID string, n int, at time.Time) []byte {
	b, _ := json.Marshal(createdPayload{
		OrderID: orderID, CustomerID: "c-" + strconv.Itoa(n%1000), Currency: "EUR",
		Items: benchItems, Total: 2500, CreatedAt: at.UTC(),
	})
	return b
}

// loadEnvelopes reads the pending rows as the relay would hand them to its
// publisher, in id order.
func loadEnvelopes(ctx context.Context, pool *pgxpool.Pool) ([]outbox.Envelope, error) {
	rows, err := pool.Query(ctx, `
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers, created_at, attempts + 1
FROM outbox ORDER BY id`)
	if err != nil {
		return nil, fmt.Errorf("load envelopes: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (outbox.Envelope, error) {
		var e outbox.Envelope
		err := r.Scan(&e.ID, &e.AggregateType, &e.AggregateID, &e.AggregateVersion, &e.EventType,
			&e.Payload, &e.Headers, &e.CreatedAt, &e.Attempt)
		return e, err
	})
}

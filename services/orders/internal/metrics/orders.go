package metrics

import "github.com/prometheus/client_golang/prometheus"

// Orders counts what the API did to orders, and whether the relay's publisher
// can reach the broker.
type Orders struct {
	created   prometheus.Counter
	cancelled prometheus.Counter
}

// NewOrders registers the orders counters on reg.
func NewOrders(reg prometheus.Registerer) *Orders {
	m := &Orders{
		created: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orders_created_total", Help: "Orders created (an idempotent replay of a creation is not counted)."}),
		cancelled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "orders_cancelled_total", Help: "Orders cancelled (cancelling a cancelled order is not counted)."}),
	}
	reg.MustRegister(m.created, m.cancelled)
	return m
}

// Created counts one order created.
func (m *Orders) Created() { m.created.Inc() }

// Cancelled counts one order cancelled.
func (m *Orders) Cancelled() { m.cancelled.Inc() }

// RegisterPublisherReady registers outbox_publisher_ready on reg: 1 while
// ready (the relay's publisher's Ready) returns nil, 0 otherwise. It is what
// the standalone relay's /readyz reports as "broker", readable by Prometheus.
func RegisterPublisherReady(reg prometheus.Registerer, ready func() error) {
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "outbox_publisher_ready",
		Help: "1 while the relay's publisher is connected to the broker and not blocked by it.",
	}, func() float64 {
		if ready() != nil {
			return 0
		}
		return 1
	}))
}

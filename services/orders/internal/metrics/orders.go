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

// RegisterBrokerNodes registers amqp_nodes_configured on reg: n, the number
// of broker nodes AMQP_URL lists (3 on a cluster). The cluster's majority
// alert reads it, so a cluster the relays are configured for pages for as
// long as its nodes do not answer, even after their scrape targets vanished.
func RegisterBrokerNodes(reg prometheus.Registerer, n int) {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "amqp_nodes_configured",
		Help: "Broker nodes the process is configured with (the URLs in AMQP_URL).",
	})
	g.Set(float64(n))
	reg.MustRegister(g)
}

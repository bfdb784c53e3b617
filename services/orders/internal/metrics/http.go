package metrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Requests measures the API's requests: http_server_request_duration_seconds,
// a histogram by method, route (the router's pattern, such as
// "/orders/{id}", so that each route is one series whatever its ids) and
// status code. Its _count is the request rate, its 5xx share the errors
// (the OrdersAPIWriteErrorBudgetBurn alerts), its buckets the duration.
type Requests struct {
	duration *prometheus.HistogramVec
}

// NewRequests registers the request histogram on reg.
func NewRequests(reg prometheus.Registerer) *Requests {
	m := &Requests{duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "http_server_request_duration_seconds",
		Help:    "Requests the orders API answered, by method, route pattern and status code, and how long each took.",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
	}, []string{"method", "route", "code"})}
	reg.MustRegister(m.duration)
	return m
}

// ObserveRequest records one request answered with status after d.
func (m *Requests) ObserveRequest(method, route string, status int, d time.Duration) {
	m.duration.WithLabelValues(method, route, strconv.Itoa(status)).Observe(d.Seconds())
}

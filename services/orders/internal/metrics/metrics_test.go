package metrics_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/services/orders/internal/metrics"
)

// The counters operators alert on are exposed under their documented names
// and move with the relay's observations.
func TestRelayExposesTheFailureCounters(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m := metrics.NewRelay(reg)
	ctx := context.Background()
	for _, o := range []outbox.Observation{
		{Kind: outbox.KindClaimFailed},
		{Kind: outbox.KindClaimFailed},
		{Kind: outbox.KindMarkFailed},
		{Kind: outbox.KindUnmarked, N: 3},
		{Kind: outbox.KindListenReconnected},
		{Kind: outbox.KindListenFallback, Fallback: true},
		{Kind: "a kind added later"},
	} {
		m.Observe(ctx, o)
	}

	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		for _, metric := range f.GetMetric() {
			if c := metric.GetCounter(); c != nil {
				got[f.GetName()] = c.GetValue()
			}
			if g := metric.GetGauge(); g != nil {
				got[f.GetName()] = g.GetValue()
			}
		}
	}
	for name, want := range map[string]float64{
		"outbox_claim_failures_total":    2,
		"outbox_mark_failures_total":     1,
		"outbox_unmarked_total":          3,
		"outbox_listen_reconnects_total": 1,
		"outbox_listen_fallback":         1,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s = %v (exposed: %v), want %v", name, v, ok, want)
		}
	}
}

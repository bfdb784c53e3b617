package app_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	amqp "github.com/rabbitmq/amqp091-go"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/services/shipping/internal/app"
)

func histogram(t *testing.T, h prometheus.Histogram) *dto.Histogram {
	t.Helper()
	var m dto.Metric
	if err := h.(prometheus.Metric).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram()
}

// The service level indicator: an event applied is observed once, from the
// creation time the relay sends (outboxamqp's header, to the microsecond)
// to its effect, with its process span's trace id as exemplar; a duplicate
// and an event without the header are not observed.
func TestCommitToAppliedIsObservedOncePerEffectWithItsTrace(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	tr := startTraced(t, e, sdktrace.ParentBased(sdktrace.AlwaysSample()), app.Config{})
	hist := tr.app.Metrics().CommitToApplied

	createdAt := time.Now().Add(-2 * time.Second)
	sent := outboxamqp.Publishing(outbox.Envelope{ID: 1, AggregateType: "order", AggregateID: "order-sli-1",
		AggregateVersion: 1, EventType: "order.created", CreatedAt: createdAt})
	ev := created("sli-1", "order-sli-1")
	ev.Headers = amqp.Table{outboxamqp.HeaderCreatedAt: sent.Headers[outboxamqp.HeaderCreatedAt], "traceparent": traceparent("01")}
	e.pub.publish(ev)
	e.waitShipment("order-sli-1", 1)
	span := tr.waitProcessSpans(t, "sli-1", 1)[0]

	h := histogram(t, hist)
	if h.GetSampleCount() != 1 || h.GetSampleSum() < 2 || h.GetSampleSum() > 120 {
		t.Fatalf("commit to applied: %d observations summing %vs, want one of at least 2s", h.GetSampleCount(), h.GetSampleSum())
	}
	var exemplars []string
	for _, b := range h.GetBucket() {
		if b.GetUpperBound() < 2 && b.GetCumulativeCount() != 0 {
			t.Errorf("bucket le=%v counts %d: the event took 2s or more", b.GetUpperBound(), b.GetCumulativeCount())
		}
		for _, l := range b.GetExemplar().GetLabel() {
			if l.GetName() == "trace_id" {
				exemplars = append(exemplars, l.GetValue())
			}
		}
	}
	if want := span.SpanContext().TraceID().String(); len(exemplars) != 1 || exemplars[0] != want {
		t.Errorf("exemplar trace ids %v, want the process span's %s", exemplars, want)
	}

	// The same message again: a duplicate, absorbed, not observed.
	e.pub.publish(ev)
	waitFor(t, 60*time.Second, "the duplicate", func() bool { return dupInbox(tr.app) == 1 })
	// An event without the header (another producer): applied, not observed.
	e.pub.publish(created("sli-2", "order-sli-2"))
	e.waitShipment("order-sli-2", 1)
	waitFor(t, 60*time.Second, "both effects counted", func() bool { return processed(tr.app) == 2 })
	if n := histogram(t, hist).GetSampleCount(); n != 1 {
		t.Errorf("commit to applied has %d observations, want 1 (one effect with a creation time)", n)
	}
}

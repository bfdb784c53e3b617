package main

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// The shipping service's debug line per settled delivery is counted, by
// message, and kept off the terminal; every other line goes to the terminal.
func TestDeliveryLogReadsShippingsDebugLines(t *testing.T) {
	l := newDeliveryLog()
	lines := []struct {
		line string
		show bool
	}{
		{`{"time":"2026-12-01T08:00:00.000Z","level":"DEBUG","msg":"applied","service":"shipping","event_id":"7","aggregate_id":"a","version":1}`, false},
		{`{"time":"2026-12-01T08:00:01.000Z","level":"DEBUG","msg":"duplicate (inbox)","service":"shipping","event_id":"7"}`, false},
		{`{"time":"2026-12-01T08:00:02.000Z","level":"DEBUG","msg":"duplicate (already applied)","service":"shipping","event_id":"7"}`, false},
		{`{"time":"2026-12-01T08:00:03.000Z","level":"DEBUG","msg":"deferred","service":"shipping","event_id":"8","reason":"gap"}`, false},
		{`{"time":"2026-12-01T08:00:03.000Z","level":"DEBUG","msg":"something else","service":"shipping"}`, false},
		{`{"time":"2026-12-01T08:00:04.000Z","level":"INFO","msg":"consuming","service":"shipping"}`, true},
		{`{"time":"2026-12-01T08:00:04.000Z","level":"WARN","msg":"applied","service":"shipping","event_id":"9"}`, true},
		{`demo: shipping restarted (pid 1)`, true},
		{`{not json "DEBUG"`, true},
	}
	for _, c := range lines {
		if got := l.line([]byte(c.line)); got != c.show {
			t.Errorf("line(%s) = %v, want %v", c.line, got, c.show)
		}
	}
	want := deliveryCounts{Delivered: 4, Applied: 1, DuplicatesInbox: 1, DuplicatesVersion: 1, Deferred: 1}
	if got := l.counts(); got != want {
		t.Fatalf("counts = %+v, want %+v", got, want)
	}
	d := l.of("7")
	if len(d) != 3 || d[0].Outcome != "applied" || d[1].Outcome != "duplicate (inbox)" || d[2].Outcome != "duplicate (version)" ||
		!d[0].At.Equal(time.Date(2026, 12, 1, 8, 0, 0, 0, time.UTC)) {
		t.Fatalf("deliveries of 7 = %+v", d)
	}
	if d := l.of("404"); len(d) != 0 {
		t.Fatalf("deliveries of an unknown message = %+v", d)
	}
}

func TestDeliveryLogKeepsTheLatestMessages(t *testing.T) {
	l := newDeliveryLog()
	for i := range maxTracked + 10 {
		l.record(strconv.Itoa(i), delivery{Outcome: "applied"})
	}
	if len(l.byID) != maxTracked || len(l.order) != maxTracked || len(l.of("0")) != 0 || len(l.of(strconv.Itoa(maxTracked+9))) != 1 {
		t.Fatalf("tracking %d/%d messages, want %d", len(l.byID), len(l.order), maxTracked)
	}
	if got := l.counts().Applied; got != maxTracked+10 {
		t.Fatalf("applied = %d, want every delivery counted", got)
	}
}

func TestNotReadyReason(t *testing.T) {
	for body, want := range map[string]string{
		`{"checks":{"broker":"not consuming from the broker","mongodb":"ok"},"status":"not ready"}`: "broker: not consuming from the broker",
		`{"status":"unavailable","broker":"dial: refused","database":"ok"}`:                         "broker: dial: refused",
		`plain text`: "plain text",
	} {
		if got := notReadyReason([]byte(body)); got != want {
			t.Errorf("notReadyReason(%s) = %q, want %q", body, got, want)
		}
	}
}

func TestParseMetrics(t *testing.T) {
	m, err := parseMetrics(strings.NewReader(`# HELP shipping_dead_letters x
# TYPE shipping_dead_letters gauge
shipping_dead_letters 2
shipping_events_duplicate_total{layer="inbox"} 5
outbox_published_total 1.5e+06
`))
	if err != nil {
		t.Fatal(err)
	}
	if n := m.int("shipping_dead_letters"); n == nil || *n != 2 {
		t.Fatalf("shipping_dead_letters = %v", n)
	}
	if n := m.int("outbox_published_total"); n == nil || *n != 1_500_000 {
		t.Fatalf("outbox_published_total = %v", n)
	}
	if m[`shipping_events_duplicate_total{layer="inbox"}`] != 5 {
		t.Fatalf("labelled series: %v", m)
	}
	if n := m.int("absent"); n != nil {
		t.Fatalf("absent = %v, want nil", *n)
	}
}

func TestMongoDatabase(t *testing.T) {
	for uri, want := range map[string]string{
		"mongodb://127.0.0.1:27017/shipping":             "shipping",
		"mongodb://127.0.0.1:27017/other?replicaSet=rs0": "other",
		"mongodb://127.0.0.1:27017":                      "shipping",
		"mongodb://127.0.0.1:27017/":                     "shipping",
	} {
		if got := mongoDatabase(uri); got != want {
			t.Errorf("mongoDatabase(%s) = %q, want %q", uri, got, want)
		}
	}
}

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxadmin"
)

// journey is one order's way through the system, for /api/journey.
type journey struct {
	OrderID   string         `json:"order_id"`
	Status    string         `json:"status"`
	Version   int64          `json:"version"`
	CreatedAt time.Time      `json:"created_at"`
	Events    []journeyEvent `json:"events"`
	// Shipment is the shipment's status, "" while shipping has none.
	Shipment string `json:"shipment"`
}

// journeyEvent is one of the order's events: its outbox row, what the relay
// did with it, what shipping did with each delivery, and whether its effect
// was applied.
type journeyEvent struct {
	MessageID string    `json:"message_id"`
	EventType string    `json:"event_type"`
	Version   int64     `json:"version"`
	WrittenAt time.Time `json:"written_at"`
	// State is pending, in_flight, dead_lettered, published or discarded.
	State          string     `json:"state"`
	Attempts       int64      `json:"attempts"`
	LastError      string     `json:"last_error,omitempty"`
	NextAttemptAt  *time.Time `json:"next_attempt_at,omitempty"`
	PublishedAt    *time.Time `json:"published_at,omitempty"`
	DeadLetteredAt *time.Time `json:"dead_lettered_at,omitempty"`
	Deliveries     []delivery `json:"deliveries"`
	// Applied counts the shipment's entries for this version: 1 once
	// applied, and never more.
	Applied   int        `json:"applied"`
	AppliedAt *time.Time `json:"applied_at,omitempty"`
	// TraceID is the trace of the request that wrote the event, from the
	// W3C traceparent stored in the outbox row's headers; "" when the row
	// has none (tracing off, and no trace context from the client).
	TraceID string `json:"trace_id,omitempty"`
	// TraceURL is that trace in the Jaeger UI, when one is configured.
	TraceURL string `json:"trace_url,omitempty"`
}

func (v *liveView) serveJourney(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("order")
	if _, err := uuid.Parse(id); err != nil || len(id) != 36 {
		writeError(w, http.StatusBadRequest, "invalid_order_id", "order: want an order id (a UUID)")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	j, status, err := v.journey(ctx, id)
	if err != nil {
		writeError(w, status, "unavailable", err.Error())
		return
	}
	writeJSON(w, http.StatusOK, j)
}

func (v *liveView) journey(ctx context.Context, id string) (journey, int, error) {
	var j journey
	var order struct {
		ID        string    `json:"id"`
		Status    string    `json:"status"`
		Version   int64     `json:"version"`
		CreatedAt time.Time `json:"created_at"`
	}
	status, err := v.getJSON(ctx, "http://"+v.d.cfg.OrdersAddr+"/orders/"+id, &order)
	switch {
	case err != nil:
		return j, http.StatusBadGateway, fmt.Errorf("orders API: %w", err)
	case status == http.StatusNotFound:
		return j, http.StatusNotFound, fmt.Errorf("no order %s", id)
	case status != http.StatusOK:
		return j, http.StatusBadGateway, fmt.Errorf("orders API answered %d", status)
	}
	j = journey{OrderID: order.ID, Status: order.Status, Version: order.Version, CreatedAt: order.CreatedAt, Events: []journeyEvent{}}

	history, err := outboxadmin.New(v.pool).History(ctx, "order", id)
	if err != nil {
		return j, http.StatusBadGateway, err
	}
	for _, h := range history {
		e := journeyEvent{
			MessageID: h.MessageID(), // as the relay publishes it
			EventType: h.EventType, Version: h.AggregateVersion, WrittenAt: h.CreatedAt,
			State: string(h.State), Attempts: int64(h.Attempts), LastError: h.LastError,
			NextAttemptAt: timeOrNil(h.NextAttemptAt), DeadLetteredAt: timeOrNil(h.DeadLetteredAt),
			TraceID: traceID(h.Headers["traceparent"]),
		}
		if h.InFlight {
			e.State = "in_flight"
		}
		if h.State == outbox.EventPublished {
			e.PublishedAt = timeOrNil(h.Since)
		}
		if e.TraceID != "" && v.d.cfg.JaegerUI != "" {
			e.TraceURL = strings.TrimRight(v.d.cfg.JaegerUI, "/") + "/trace/" + e.TraceID
		}
		e.Deliveries = v.d.deliveries.of(e.MessageID)
		if e.Deliveries == nil {
			e.Deliveries = []delivery{}
		}
		j.Events = append(j.Events, e)
	}

	var shipment struct {
		Status string `json:"status"`
		Events []struct {
			Version   int64     `json:"version"`
			AppliedAt time.Time `json:"applied_at"`
		} `json:"events"`
	}
	status, err = v.getJSON(ctx, "http://"+v.d.cfg.ShippingAddr+"/shipments/"+id, &shipment)
	if err != nil || (status != http.StatusOK && status != http.StatusNotFound) {
		// Shipping down (killed, restarting): the rest of the journey stands.
		return j, http.StatusOK, nil
	}
	j.Shipment = shipment.Status
	for i := range j.Events {
		for _, a := range shipment.Events {
			if a.Version == j.Events[i].Version {
				j.Events[i].Applied++
				at := a.AppliedAt
				j.Events[i].AppliedAt = &at
			}
		}
	}
	return j, http.StatusOK, nil
}

// timeOrNil is t, or nil for the zero time (a field the JSON leaves out).
func timeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// traceID is the trace id of a W3C traceparent (version-traceid-parentid-
// flags, lowercase hex), or "" for one that is not valid.
func traceID(traceparent string) string {
	parts := strings.Split(strings.TrimSpace(traceparent), "-")
	if len(parts) < 4 || len(parts[0]) != 2 || parts[0] == "ff" || len(parts[1]) != 32 || len(parts[2]) != 16 || len(parts[3]) != 2 ||
		(parts[0] == "00" && len(parts) != 4) {
		return ""
	}
	for _, p := range parts[:4] {
		if strings.Trim(p, "0123456789abcdef") != "" {
			return ""
		}
	}
	if strings.Trim(parts[1], "0") == "" || strings.Trim(parts[2], "0") == "" {
		return "" // all zeros: invalid
	}
	return parts[1]
}

// getJSON GETs url into out (on 200) and returns the status.
func (v *liveView) getJSON(ctx context.Context, url string, out any) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := v.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(body, out); err != nil {
			return 0, fmt.Errorf("GET %s: %w", url, err)
		}
	}
	return resp.StatusCode, nil
}

package httpapi_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-inbox/reference/services/shipping/internal/httpapi"
	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

type noShipments struct{}

func (noShipments) Get(context.Context, string) (shipment.Shipment, error) {
	return shipment.Shipment{}, shipment.ErrNotFound
}

type fakeDeadLetters struct{ calls []string }

func (f *fakeDeadLetters) List(context.Context) ([]shipment.Letter, []shipment.Hold, error) {
	return []shipment.Letter{{OrderID: "o-1", Version: 2, Reason: "handler_failed"}}, []shipment.Hold{}, nil
}

func (f *fakeDeadLetters) settle(what, orderID string, version int64) (int, error) {
	f.calls = append(f.calls, what+" "+orderID)
	switch {
	case version == 9:
		return 0, shipment.ErrNoDeadLetter
	case version == 8:
		return 1, errors.New("broker gone")
	case version == 7:
		return 0, fmt.Errorf("replay: %w", shipment.ErrBodyNotKept)
	}
	return 3, nil
}

func (f *fakeDeadLetters) Replay(_ context.Context, orderID string, version int64) (int, error) {
	return f.settle("replay", orderID, version)
}

func (f *fakeDeadLetters) Discard(_ context.Context, orderID string, version int64) (int, error) {
	return f.settle("discard", orderID, version)
}

func TestAdminDeadLetterEndpoints(t *testing.T) {
	dl := &fakeDeadLetters{}
	h, err := httpapi.New(httpapi.Config{Shipments: noShipments{}, Gatherer: prometheus.NewRegistry(), DeadLetters: dl, AdminToken: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	off, _ := httpapi.New(httpapi.Config{Shipments: noShipments{}, Gatherer: prometheus.NewRegistry(), DeadLetters: dl})
	do := func(h http.Handler, method, path, token string) (int, string) {
		req := httptest.NewRequest(method, path, nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		b, _ := io.ReadAll(w.Result().Body)
		return w.Code, string(b)
	}
	for _, tc := range []struct {
		h                   http.Handler
		method, path, token string
		status              int
		body                string
	}{
		{off, "GET", "/admin/dead-letters", "tok", 404, "not found"},
		{h, "GET", "/admin/dead-letters", "", 401, "bearer token"},
		{h, "GET", "/admin/dead-letters", "nope", 401, "bearer token"},
		{h, "GET", "/admin/dead-letters", "tok", 200, `"reason":"handler_failed"`},
		{h, "POST", "/admin/dead-letters/o-1/2/replay", "tok", 200, `"released":3`},
		{h, "POST", "/admin/dead-letters/o-1/2/discard", "tok", 200, `"discarded":1`},
		{h, "POST", "/admin/dead-letters/o-1/zero/replay", "tok", 400, "positive version"},
		{h, "POST", "/admin/dead-letters/o-1/0/discard", "tok", 400, "positive version"},
		{h, "POST", "/admin/dead-letters/o-1/9/replay", "tok", 404, "no dead letter"},
		{h, "POST", "/admin/dead-letters/o-1/8/replay", "tok", 503, "run it again"},
		{h, "POST", "/admin/dead-letters/o-1/7/replay", "tok", 409, "dead-letter queue, or discard it"},
		{h, "POST", "/admin/dead-letters/o-1/2/replay", "", 401, "bearer token"},
	} {
		status, body := do(tc.h, tc.method, tc.path, tc.token)
		if status != tc.status || !strings.Contains(body, tc.body) {
			t.Errorf("%s %s (token %q): %d %s; want %d with %q", tc.method, tc.path, tc.token, status, body, tc.status, tc.body)
		}
	}
	if strings.Join(dl.calls, ",") != "replay o-1,discard o-1,replay o-1,replay o-1,replay o-1" {
		t.Errorf("calls %v", dl.calls)
	}
}

package shipment_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-inbox/reference/services/shipping/internal/shipment"
)

func amendedMsg(version int64, body string) shipment.Message {
	return msg(func(m *shipment.Message) {
		m.Type, m.RoutingKey, m.Headers["aggregate_version"], m.Body = shipment.TypeAmended, shipment.TypeAmended, version, []byte(body)
	})
}

func TestDecodeAmended(t *testing.T) {
	ev, err := shipment.Decode(amendedMsg(7, `{"order_id":"o-1","note":"ring twice","amended_at":"2026-11-29T22:01:00Z"}`))
	if err != nil || ev.Type != shipment.TypeAmended || ev.Version != 7 || ev.OrderID != "o-1" || ev.Ignored ||
		ev.Amended == nil || ev.Amended.Note != "ring twice" {
		t.Fatalf("Decode: %+v, %v", ev, err)
	}
	for name, c := range map[string]struct {
		m      shipment.Message
		reason shipment.Reason
	}{
		"version 1":         {amendedMsg(1, `{"order_id":"o-1","note":"n"}`), shipment.ReasonInvalidVersion},
		"no note":           {amendedMsg(2, `{"order_id":"o-1"}`), shipment.ReasonMalformedPayload},
		"note too long":     {amendedMsg(2, `{"order_id":"o-1","note":"`+strings.Repeat("x", shipment.MaxNoteBytes+1)+`"}`), shipment.ReasonMalformedPayload},
		"no order id":       {amendedMsg(2, `{"note":"n"}`), shipment.ReasonMalformedPayload},
		"other order":       {amendedMsg(2, `{"order_id":"o-2","note":"n"}`), shipment.ReasonMalformedPayload},
		"not an object":     {amendedMsg(2, `[1]`), shipment.ReasonMalformedPayload},
		"note not a string": {amendedMsg(2, `{"order_id":"o-1","note":5}`), shipment.ReasonMalformedPayload},
	} {
		var ie *shipment.InvalidError
		if _, err := shipment.Decode(c.m); !errors.As(err, &ie) || ie.Reason != c.reason {
			t.Errorf("%s: %v, want %s", name, err, c.reason)
		}
	}
}

// A chain of any length builds: the note is the last amendment's, the
// status the cancel's.
func TestBuildLongChain(t *testing.T) {
	at := time.Date(2026, 11, 29, 22, 0, 0, 0, time.UTC)
	recs := []shipment.Record{{Applied: shipment.Applied{MessageID: "m1", EventType: shipment.TypeCreated, Version: 1, AppliedAt: at},
		Created: &shipment.Created{OrderID: "o-1", CustomerID: "c", Currency: "EUR", Total: 5}}}
	for v := int64(2); v <= 19; v++ {
		recs = append(recs, shipment.Record{Applied: shipment.Applied{MessageID: "m", EventType: shipment.TypeAmended, Version: v, AppliedAt: at},
			Amended: &shipment.Amended{OrderID: "o-1", Note: "note " + string(rune('a'+v))}})
	}
	s, err := shipment.Build("o-1", recs)
	if err != nil || s.Version != 19 || s.Note != "note "+string(rune('a'+19)) || s.Status != shipment.StatusPending || len(s.Events) != 19 {
		t.Fatalf("Build: %+v, %v", s, err)
	}
	recs = append(recs, shipment.Record{Applied: shipment.Applied{MessageID: "mc", EventType: shipment.TypeCancelled, Version: 20, AppliedAt: at},
		Cancelled: &shipment.Cancelled{OrderID: "o-1"}})
	if s, err = shipment.Build("o-1", recs); err != nil || s.Status != shipment.StatusCancelled || s.Version != 20 || s.Note == "" {
		t.Fatalf("Build with the cancel: %+v, %v", s, err)
	}
}

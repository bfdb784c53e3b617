package order

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"
)

func TestAmendRequestValidate(t *testing.T) {
	a, err := AmendRequest{Note: ptr("leave at the back door")}.Validate()
	if err != nil || a.Note != "leave at the back door" {
		t.Fatalf("valid request: %+v, %v", a, err)
	}
	if _, err := (AmendRequest{Note: ptr(strings.Repeat("é", MaxNoteLength))}).Validate(); err != nil {
		t.Errorf("note of %d characters refused: %v", MaxNoteLength, err)
	}
	for name, note := range map[string]*string{
		"missing":   nil,
		"empty":     ptr(""),
		"blank":     ptr(" \t "),
		"too long":  ptr(strings.Repeat("x", MaxNoteLength+1)),
		"NUL":       ptr("a\x00b"),
		"control":   ptr("a\x1b[2Jb"),
		"bad UTF-8": ptr("a\xffb"),
	} {
		var ve *ValidationError
		if _, err := (AmendRequest{Note: note}).Validate(); !errors.As(err, &ve) || ve.Field != "note" {
			t.Errorf("%s note: error %v, want a ValidationError on note", name, err)
		}
	}
}

func TestRequireIdempotencyKey(t *testing.T) {
	if k, err := RequireIdempotencyKey([]string{"a-1"}); err != nil || k != "a-1" {
		t.Fatalf("one valid key: %q, %v", k, err)
	}
	for _, vs := range [][]string{nil, {}, {"a", "b"}, {""}, {"has space"}} {
		var ve *ValidationError
		if _, err := RequireIdempotencyKey(vs); !errors.As(err, &ve) || ve.Field != "Idempotency-Key" {
			t.Errorf("%q: error %v, want a ValidationError on Idempotency-Key", vs, err)
		}
	}
}

// FuzzAmendRequest: whatever body a client sends, Validate either refuses it
// with a ValidationError on note or returns a note within the limits, which
// the order.amended event carries unchanged.
func FuzzAmendRequest(f *testing.F) {
	for _, s := range []string{`{"note": "ring twice"}`, `{"note": ""}`, `{"note": null}`, `{}`, `{"note": "\u0000"}`,
		`{"note": "` + strings.Repeat("é", MaxNoteLength) + `"}`, `{"note": "\ud800"}`, `{"note": "a\u2028b"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var r AmendRequest
		if json.Unmarshal(body, &r) != nil {
			return
		}
		a, err := r.Validate()
		if err != nil {
			var ve *ValidationError
			if !errors.As(err, &ve) || ve.Field != "note" {
				t.Fatalf("Validate(%q): %v, want a ValidationError on note", body, err)
			}
			return
		}
		n := a.Note
		if !utf8.ValidString(n) || strings.TrimSpace(n) == "" || utf8.RuneCountInString(n) > MaxNoteLength ||
			strings.ContainsFunc(n, unicode.IsControl) {
			t.Fatalf("Validate(%q) accepted note %q", body, n)
		}
		payload, err := AmendedEvent(Amendment{OrderID: "o", Version: 2, Note: n, AmendedAt: time.Unix(0, 0)})
		if err != nil {
			t.Fatal(err)
		}
		var back AmendedPayload
		if err := json.Unmarshal(payload, &back); err != nil || back.Note != n || back.OrderID != "o" {
			t.Fatalf("order.amended of note %q decodes to %+v, %v", n, back, err)
		}
	})
}

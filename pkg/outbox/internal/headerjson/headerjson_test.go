package headerjson

import (
	"encoding/json"
	"maps"
	"testing"
)

var seeds = []string{
	`{}`,
	`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`,
	`{"baggage": "k=v", "tracestate": "congo=t61rcWkgMzE", "traceparent": "00-aa-bb-01"}`,
	`{"a":"1","b":"2"}`,
	" \n{ \"a\" :\t\"x\" , \"b\":\"\" }\r\n",
	`{"a": "1", "a": "2"}`,
	`{"é": "ünïcødé ✓"}`,
	`{"q": "say \"hi\""}`,
	`{"nl": "a\nb", "u": "\u00e9\ud83d\ude00"}`,
	`{"bad": "\ud800"}`,
	"{\"ctl\": \"a\x01b\"}",
	"{\"raw\": \"\xff\xfe\"}",
	`{"n": 1}`,
	`{"n": null}`,
	`{"o": {"x": "y"}}`,
	`null`,
	`[]`,
	`"s"`,
	``,
	`{`,
	`{"a"`,
	`{"a":`,
	`{"a":"b"`,
	`{"a":"b",}`,
	`{"a":"b"} x`,
	`{"a":"b"}{}`,
	`{,}`,
	`{"a" "b"}`,
	`{'a': 'b'}`,
}

// agree checks Decode against encoding/json on b.
func agree(t *testing.T, b []byte) {
	t.Helper()
	got, gotErr := Decode(b)
	var want map[string]string
	wantErr := json.Unmarshal(b, &want)
	if (gotErr == nil) != (wantErr == nil) {
		t.Fatalf("Decode(%q) error %v, encoding/json %v", b, gotErr, wantErr)
	}
	if wantErr != nil {
		return
	}
	if (got == nil) != (want == nil) || !maps.Equal(got, want) {
		t.Fatalf("Decode(%q) = %#v, encoding/json %#v", b, got, want)
	}
}

func TestDecodeAgreesWithEncodingJSON(t *testing.T) {
	t.Parallel()
	for _, s := range seeds {
		agree(t, []byte(s))
	}
}

// The fast path must take what the headers column holds: jsonb's text of an
// object of plain strings. Without this, a plain that gave up on everything
// would agree with encoding/json and save nothing.
func TestPlainReadsWhatJSONBPrints(t *testing.T) {
	t.Parallel()
	for _, s := range []string{seeds[0], seeds[1], seeds[2], seeds[3], seeds[4], seeds[6]} {
		if _, ok := plain([]byte(s)); !ok {
			t.Errorf("plain(%q) fell back to encoding/json", s)
		}
	}
	for _, s := range []string{seeds[7], seeds[8], seeds[10], seeds[11], seeds[12]} {
		if _, ok := plain([]byte(s)); ok {
			t.Errorf("plain(%q) took it: it must go to encoding/json", s)
		}
	}
}

func FuzzDecodeAgreesWithEncodingJSON(f *testing.F) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) { agree(t, b) })
}

func BenchmarkDecode(b *testing.B) {
	in := []byte(seeds[2])
	b.Run("headerjson", func(b *testing.B) {
		for b.Loop() {
			if _, err := Decode(in); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding_json", func(b *testing.B) {
		for b.Loop() {
			var m map[string]string
			if err := json.Unmarshal(in, &m); err != nil {
				b.Fatal(err)
			}
		}
	})
}

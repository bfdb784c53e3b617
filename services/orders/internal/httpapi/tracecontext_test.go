package httpapi

import (
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"
)

const (
	testTraceID  = "4bf92f3577b34da6a3ce929d0e0e4736"
	testParentID = "00f067aa0ba902b7"
	testParent   = "00-" + testTraceID + "-" + testParentID + "-01"
)

func TestParseTraceparent(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		fields []string
		want   string // "" for invalid
	}{
		{"valid, sampled", []string{testParent}, testParent},
		{"valid, not sampled", []string{"00-" + testTraceID + "-" + testParentID + "-00"}, "00-" + testTraceID + "-" + testParentID + "-00"},
		{"unknown flags are cleared", []string{"00-" + testTraceID + "-" + testParentID + "-09"}, testParent},
		{"only unknown flags", []string{"00-" + testTraceID + "-" + testParentID + "-fe"}, "00-" + testTraceID + "-" + testParentID + "-00"},
		{"later version, same length", []string{"01-" + testTraceID + "-" + testParentID + "-01"}, testParent},
		{"later version, more fields", []string{"cc-" + testTraceID + "-" + testParentID + "-01-what-the-future-will-be-like"}, testParent},
		{"later version, more without a dash", []string{"cc-" + testTraceID + "-" + testParentID + "-01xyz"}, ""},
		{"version ff", []string{"ff-" + testTraceID + "-" + testParentID + "-01"}, ""},
		{"version not hex", []string{"0g-" + testTraceID + "-" + testParentID + "-01"}, ""},
		{"version upper case", []string{"0A-" + testTraceID + "-" + testParentID + "-01"}, ""},
		{"trace id upper case", []string{"00-" + strings.ToUpper(testTraceID) + "-" + testParentID + "-01"}, ""},
		{"parent id upper case", []string{"00-" + testTraceID + "-00F067AA0BA902B7-01"}, ""},
		{"flags upper case", []string{"00-" + testTraceID + "-" + testParentID + "-0A"}, ""},
		{"flags not hex", []string{"00-" + testTraceID + "-" + testParentID + "-0x"}, ""},
		{"all-zero trace id", []string{"00-00000000000000000000000000000000-" + testParentID + "-01"}, ""},
		{"all-zero parent id", []string{"00-" + testTraceID + "-0000000000000000-01"}, ""},
		{"version 00 too long", []string{testParent + "-"}, ""},
		{"version 00 with more fields", []string{testParent + "-extra"}, ""},
		{"too short", []string{testParent[:54]}, ""},
		{"short trace id", []string{"00-" + testTraceID[1:] + "-" + testParentID + "-01"}, ""},
		{"wrong delimiter", []string{"00_" + testTraceID + "-" + testParentID + "-01"}, ""},
		{"invalid UTF-8", []string{"00-" + testTraceID[:30] + "\xff\xfe-" + testParentID + "-01"}, ""},
		{"trailing space", []string{testParent + " "}, ""},
		{"empty", []string{""}, ""},
		{"absent", nil, ""},
		{"two fields", []string{testParent, testParent}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseTraceparent(tc.fields)
			if ok != (tc.want != "") || got != tc.want {
				t.Fatalf("parseTraceparent(%q) = %q, %v; want %q", tc.fields, got, ok, tc.want)
			}
		})
	}
}

func TestParseTracestate(t *testing.T) {
	t.Parallel()
	members := func(n, size int) []string {
		m := make([]string, n)
		for i := range m {
			k := fmt.Sprintf("k%02d=", i)
			m[i] = k + strings.Repeat("v", size-len(k))
		}
		return m
	}
	const invalid = "<invalid>"
	for _, tc := range []struct {
		name   string
		fields []string
		want   string
	}{
		{"absent", nil, ""},
		{"empty", []string{""}, ""},
		{"one member", []string{"congo=t61rcWkgMzE"}, "congo=t61rcWkgMzE"},
		{"optional whitespace", []string{"congo=t61rcWkgMzE , \trojo=00f067aa0ba902b7"}, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"},
		{"empty members", []string{",,a=1,, ,b=2,"}, "a=1,b=2"},
		{"two fields are one list", []string{"a=1", "b=2"}, "a=1,b=2"},
		{"32 members", members(32, 8), strings.Join(members(32, 8), ",")},
		{"33 members", members(33, 8), invalid},
		{"33 members over two fields", []string{strings.Join(members(33, 8)[:20], ","), strings.Join(members(33, 8)[20:], ",")}, invalid},
		{"duplicate key", []string{"a=1,b=2,a=3"}, invalid},
		{"duplicate key across fields", []string{"a=1", "a=3"}, invalid},
		{"no equals sign", []string{"a=1,foo"}, invalid},
		{"empty key", []string{"=1"}, invalid},
		{"empty value", []string{"a="}, invalid},
		{"equals sign in value", []string{"a=b=c"}, invalid},
		{"space inside and before a value", []string{"a= b c"}, "a= b c"},
		{"upper-case key", []string{"Congo=1"}, invalid},
		{"key starting with a digit", []string{"1a=1"}, invalid},
		{"key characters", []string{"a0_-*/=1"}, "a0_-*/=1"},
		{"key of 256", []string{"a" + strings.Repeat("b", 255) + "=1"}, "a" + strings.Repeat("b", 255) + "=1"},
		{"key of 257", []string{"a" + strings.Repeat("b", 256) + "=1"}, invalid},
		{"multi-tenant key", []string{"1tenant@vendor=1"}, "1tenant@vendor=1"},
		{"tenant of 241", []string{strings.Repeat("t", 241) + "@v=1"}, strings.Repeat("t", 241) + "@v=1"},
		{"tenant of 242", []string{strings.Repeat("t", 242) + "@v=1"}, invalid},
		{"system of 14", []string{"t@" + strings.Repeat("s", 14) + "=1"}, "t@" + strings.Repeat("s", 14) + "=1"},
		{"system of 15", []string{"t@" + strings.Repeat("s", 15) + "=1"}, invalid},
		{"system starting with a digit", []string{"t@1s=1"}, invalid},
		{"empty tenant", []string{"@s=1"}, invalid},
		{"two at signs", []string{"t@s@x=1"}, invalid},
		{"value of 256", []string{"a=" + strings.Repeat("v", 256)}, "a=" + strings.Repeat("v", 256)},
		{"value of 257", []string{"a=" + strings.Repeat("v", 257)}, invalid},
		{"control character in value", []string{"a=\x01"}, invalid},
		{"invalid UTF-8 in value", []string{"a=\xff\xfe"}, invalid},
		{"invalid UTF-8 in key", []string{"\xc3\x28=1"}, invalid},
		{"non-ASCII value", []string{"a=é"}, invalid},
		{"long members are dropped first", []string{"a=" + strings.Repeat("x", 200) + ",b=1,c=" + strings.Repeat("x", 200) + ",d=2,e=" + strings.Repeat("x", 200)}, "b=1,d=2"},
		{"then members from the end", members(32, 20), strings.Join(members(24, 20), ",")},
		{"512 exactly is kept", members(16, 31), strings.Join(members(16, 31), ",")}, // 16*31 + 15 commas = 511
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseTracestate(tc.fields)
			if tc.want == invalid {
				if ok {
					t.Fatalf("parseTracestate(%q) = %q, want invalid", tc.fields, got)
				}
				return
			}
			if !ok || got != tc.want {
				t.Fatalf("parseTracestate(%q) = %q, %v; want %q", tc.fields, got, ok, tc.want)
			}
		})
	}
}

func TestTraceHeaders(t *testing.T) {
	t.Parallel()
	h := http.Header{}
	h.Add("Traceparent", testParent)
	h.Add("Tracestate", "a=1, b=2")
	if got := traceHeaders(h); len(got) != 2 || got["traceparent"] != testParent || got["tracestate"] != "a=1,b=2" {
		t.Errorf("valid context: %v", got)
	}

	h.Set("Tracestate", "a=\xff")
	if got := traceHeaders(h); len(got) != 1 || got["traceparent"] != testParent {
		t.Errorf("invalid tracestate: %v, want the traceparent alone", got)
	}

	fresh := regexp.MustCompile(`^00-[0-9a-f]{32}-[0-9a-f]{16}-01$`)
	h.Set("Traceparent", "ff"+testParent[2:])
	h.Set("Tracestate", "a=1")
	got := traceHeaders(h)
	if len(got) != 1 || !fresh.MatchString(got["traceparent"]) || strings.Contains(got["traceparent"], testTraceID) {
		t.Errorf("invalid traceparent: %v, want a new trace without the tracestate", got)
	}
	if other := traceHeaders(http.Header{}); other["traceparent"] == got["traceparent"] || !fresh.MatchString(other["traceparent"]) {
		t.Errorf("two new traces: %q and %q", got["traceparent"], other["traceparent"])
	}
}

package httpapi

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strings"
)

// The W3C Trace Context headers (https://www.w3.org/TR/trace-context/), parsed
// by the specification: a client's headers are carried into the order's events
// when valid and never fail a request. An invalid traceparent starts a new
// trace (and its tracestate is ignored); an invalid tracestate is dropped.

const (
	// maxTracestateMembers is the specification's limit on list members.
	maxTracestateMembers = 32
	// maxTracestateLen is what is kept of a combined tracestate, without
	// optional whitespace; longer lists are truncated by the specification's
	// rule (members over 128 characters go first, then from the end).
	maxTracestateLen = 512
	// longTracestateMember is the size above which a member is dropped first.
	longTracestateMember = 128
)

// traceHeaders returns the trace context to store with the events of a
// request: the client's when its traceparent is valid, else a new trace.
func traceHeaders(h http.Header) map[string]string {
	parent, ok := parseTraceparent(h.Values("Traceparent"))
	if !ok {
		return map[string]string{"traceparent": newTraceparent()}
	}
	out := map[string]string{"traceparent": parent}
	if state, ok := parseTracestate(h.Values("Tracestate")); ok && state != "" {
		out["tracestate"] = state
	}
	return out
}

// parseTraceparent validates the traceparent header fields and returns the
// version-00 form of the one field. Two fields, version ff, upper-case hex,
// all-zero ids or a wrong length make it invalid. A later version is parsed
// as version 00 where it is longer than 55 characters, as the specification
// asks; its unknown flags are cleared.
func parseTraceparent(fields []string) (string, bool) {
	if len(fields) != 1 {
		return "", false
	}
	v := fields[0]
	if len(v) < 55 || v[2] != '-' || v[35] != '-' || v[52] != '-' {
		return "", false
	}
	version, traceID, parentID, flags := v[0:2], v[3:35], v[36:52], v[53:55]
	switch {
	case !isLowerHex(version) || version == "ff":
		return "", false
	case version == "00" && len(v) != 55:
		return "", false
	case len(v) > 55 && v[55] != '-':
		return "", false
	case !isLowerHex(traceID) || allZero(traceID):
		return "", false
	case !isLowerHex(parentID) || allZero(parentID):
		return "", false
	case !isLowerHex(flags):
		return "", false
	}
	sampled := "00"
	if b, _ := hex.DecodeString(flags); b[0]&1 == 1 {
		sampled = "01"
	}
	return "00-" + traceID + "-" + parentID + "-" + sampled, true
}

// parseTracestate validates the tracestate header fields as one list (fields
// are joined with commas) and returns it without optional whitespace and
// empty members, truncated to maxTracestateLen. It reports false when a member
// is malformed, a key repeats, or there are more than 32 members.
func parseTracestate(fields []string) (string, bool) {
	var members []string
	seen := map[string]bool{}
	for _, field := range fields {
		for m := range strings.SplitSeq(field, ",") {
			m = strings.Trim(m, " \t")
			if m == "" {
				continue
			}
			key, value, ok := strings.Cut(m, "=")
			if !ok || !validTracestateKey(key) || !validTracestateValue(value) || seen[key] {
				return "", false
			}
			seen[key] = true
			if members = append(members, m); len(members) > maxTracestateMembers {
				return "", false
			}
		}
	}
	if listLen(members) > maxTracestateLen {
		var kept []string
		for _, m := range members {
			if len(m) <= longTracestateMember {
				kept = append(kept, m)
			}
		}
		for listLen(kept) > maxTracestateLen {
			kept = kept[:len(kept)-1]
		}
		members = kept
	}
	return strings.Join(members, ","), true
}

func listLen(members []string) int {
	n := max(len(members)-1, 0)
	for _, m := range members {
		n += len(m)
	}
	return n
}

// validTracestateKey: a simple key (lcalpha, then up to 255 of lcalpha, digit,
// _ - * /), or tenant@system (tenant: lcalpha or digit then up to 240 more;
// system: lcalpha then up to 13 more).
func validTracestateKey(k string) bool {
	tenant, system, multi := strings.Cut(k, "@")
	if !multi {
		return len(k) >= 1 && len(k) <= 256 && isLowerAlpha(k[0]) && allKeyChars(k[1:])
	}
	return len(tenant) >= 1 && len(tenant) <= 241 && (isLowerAlpha(tenant[0]) || isDigit(tenant[0])) && allKeyChars(tenant[1:]) &&
		len(system) >= 1 && len(system) <= 14 && isLowerAlpha(system[0]) && allKeyChars(system[1:])
}

func allKeyChars(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !isLowerAlpha(c) && !isDigit(c) && c != '_' && c != '-' && c != '*' && c != '/' {
			return false
		}
	}
	return true
}

// validTracestateValue: 1 to 256 printable ASCII characters other than comma
// and equals sign, spaces allowed except at the end.
func validTracestateValue(v string) bool {
	if len(v) < 1 || len(v) > 256 || v[len(v)-1] == ' ' {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c > 0x7e || c == ',' || c == '=' {
			return false
		}
	}
	return true
}

func isLowerAlpha(c byte) bool { return c >= 'a' && c <= 'z' }
func isDigit(c byte) bool      { return c >= '0' && c <= '9' }

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if !isDigit(s[i]) && (s[i] < 'a' || s[i] > 'f') {
			return false
		}
	}
	return true
}

func allZero(s string) bool { return strings.Trim(s, "0") == "" }

// newTraceparent starts a new sampled trace.
func newTraceparent() string {
	ids := make([]byte, 24)
	for {
		_, _ = rand.Read(ids) // never fails (crypto/rand)
		traceID, parentID := hex.EncodeToString(ids[:16]), hex.EncodeToString(ids[16:])
		if !allZero(traceID) && !allZero(parentID) {
			return "00-" + traceID + "-" + parentID + "-01"
		}
	}
}

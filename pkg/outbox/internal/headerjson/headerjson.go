// Package headerjson decodes an outbox row's headers column (a JSON object
// of strings) faster than encoding/json where it can, and exactly as
// encoding/json does where it cannot.
//
// Both relays decode the headers of every event they publish, and
// encoding/json's reflection and allocations were a few microseconds per
// event of their CPU. The rows hold what Enqueue wrote, as PostgreSQL's jsonb
// prints it: one flat object of plain strings, most without a backslash. That
// shape is read here in one pass; anything else (an escape, a control
// character, invalid UTF-8, a value that is not a string, trailing data) goes
// to encoding/json, which gives the same result or error as before.
package headerjson

import (
	"encoding/json"
	"unicode/utf8"
)

// Decode returns the object b holds, as json.Unmarshal into a
// map[string]string would: the same map (nil for "null"), or its error.
func Decode(b []byte) (map[string]string, error) {
	if m, ok := plain(b); ok {
		return m, nil
	}
	var m map[string]string
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	return m, nil
}

// plain reads an object whose keys and values are strings without escapes,
// and says false for anything else.
func plain(b []byte) (map[string]string, bool) {
	if !utf8.Valid(b) {
		return nil, false // encoding/json replaces invalid bytes
	}
	i := space(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	m := make(map[string]string, 4)
	i = space(b, i+1)
	if i < len(b) && b[i] == '}' {
		return m, space(b, i+1) == len(b)
	}
	for {
		k, j, ok := str(b, i)
		if !ok {
			return nil, false
		}
		i = space(b, j)
		if i >= len(b) || b[i] != ':' {
			return nil, false
		}
		v, j, ok := str(b, space(b, i+1))
		if !ok {
			return nil, false
		}
		m[k] = v // a repeated key: the last wins, as in encoding/json
		i = space(b, j)
		if i >= len(b) {
			return nil, false
		}
		switch b[i] {
		case ',':
			i = space(b, i+1)
		case '}':
			return m, space(b, i+1) == len(b)
		default:
			return nil, false
		}
	}
}

// str reads the string that starts at b[i], if it has no escape and no
// control character, and returns it and the index after its closing quote.
func str(b []byte, i int) (string, int, bool) {
	if i >= len(b) || b[i] != '"' {
		return "", 0, false
	}
	for j := i + 1; j < len(b); j++ {
		switch c := b[j]; {
		case c == '"':
			return string(b[i+1 : j]), j + 1, true
		case c == '\\' || c < 0x20:
			return "", 0, false
		}
	}
	return "", 0, false
}

// space skips JSON whitespace from b[i].
func space(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"
)

// terminal serialises the lines of all the processes onto one writer.
type terminal struct {
	mu sync.Mutex
	w  io.Writer
}

func (t *terminal) println(line string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, _ = io.WriteString(t.w, line+"\n")
}

// prefixer writes each complete line of one process to the terminal, prefixed
// with the process's name; structured JSON log lines are shortened to
// "15:04:05 LEVEL message key=value ...". The process's output and the
// demo's notes about it (restarts) come from different goroutines.
type prefixer struct {
	term   *terminal
	prefix string
	// keep, when set, sees every complete line first and decides whether
	// the terminal shows it.
	keep func(line []byte) bool

	mu  sync.Mutex
	buf []byte
}

func newPrefixer(term *terminal, name string, width int) *prefixer {
	return &prefixer{term: term, prefix: fmt.Sprintf("%-*s | ", width, name)}
}

func (p *prefixer) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = append(p.buf, b...)
	for {
		i := bytes.IndexByte(p.buf, '\n')
		if i < 0 {
			break
		}
		if p.keep == nil || p.keep(p.buf[:i]) {
			p.term.println(p.prefix + formatLine(p.buf[:i]))
		}
		p.buf = p.buf[i+1:]
	}
	if len(p.buf) > 64<<10 { // a very long line without a newline: show it anyway
		p.term.println(p.prefix + string(p.buf))
		p.buf = p.buf[:0]
	}
	return len(b), nil
}

// formatLine shortens a slog JSON line; anything else is returned as is.
func formatLine(line []byte) string {
	line = bytes.TrimRight(line, "\r")
	if len(line) == 0 || line[0] != '{' {
		return string(line)
	}
	var rec map[string]any
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.UseNumber()
	if err := dec.Decode(&rec); err != nil {
		return string(line)
	}
	var b strings.Builder
	if ts, ok := rec["time"].(string); ok {
		if t, err := time.Parse(time.RFC3339Nano, ts); err == nil {
			b.WriteString(t.Local().Format("15:04:05") + " ")
		}
	}
	if lvl, ok := rec["level"].(string); ok {
		fmt.Fprintf(&b, "%-5s ", lvl)
	}
	if msg, ok := rec["msg"].(string); ok {
		b.WriteString(msg)
	}
	var keys []string
	for k := range rec {
		switch k {
		case "time", "level", "msg", "service": // service: the prefix says it
		default:
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		v := rec[k]
		var s string
		switch v := v.(type) {
		case string:
			s = v
			if strings.ContainsAny(s, " =\"") {
				s = fmt.Sprintf("%q", s)
			}
		default:
			raw, _ := json.Marshal(v)
			s = string(raw)
		}
		fmt.Fprintf(&b, " %s=%s", k, s)
	}
	return b.String()
}

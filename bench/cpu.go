package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// cpuTimes is the CPU time (user + system) spent so far by the servers and
// by this process, read from /proc. PostgreSQL backends that exited are
// counted through the postmaster's children times, which the kernel adds
// when it reaps them. The servers are shared with whatever else runs on the
// machine, so a delta is an upper bound of what a phase cost them.
type cpuTimes struct {
	postgres, rabbitmq, self time.Duration
	ok                       bool
}

// clockTicks is USER_HZ, 100 on every Linux this runs on.
const clockTicks = 100

func readCPUTimes() cpuTimes {
	var c cpuTimes
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return c
	}
	for _, dir := range dirs {
		b, err := os.ReadFile(filepath.Join(dir, "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		comm, fields, ok := parseStat(string(b))
		if !ok {
			continue
		}
		own, children := ticks(fields, 11)+ticks(fields, 12), ticks(fields, 13)+ticks(fields, 14)
		switch comm {
		case "postgres":
			c.postgres += own + children
		case "beam.smp", "erl_child_setup", "epmd", "inet_gethost":
			c.rabbitmq += own + children
		}
		c.ok = true
	}
	if b, err := os.ReadFile("/proc/self/stat"); err == nil {
		if _, fields, ok := parseStat(string(b)); ok {
			c.self = ticks(fields, 11) + ticks(fields, 12)
		}
	}
	return c
}

// parseStat splits /proc/PID/stat into the command name and the fields
// after it (fields[0] is the state, so utime is fields[11]).
func parseStat(s string) (string, []string, bool) {
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return "", nil, false
	}
	fields := strings.Fields(s[end+1:])
	if len(fields) < 15 {
		return "", nil, false
	}
	return s[open+1 : end], fields, true
}

func ticks(fields []string, i int) time.Duration {
	n, _ := strconv.ParseInt(fields[i], 10, 64)
	return time.Duration(n) * time.Second / clockTicks
}

// cpuPerEvent returns the CPU microseconds per event that each party spent
// between a and b.
func cpuPerEvent(a, b cpuTimes, events int) map[string]float64 {
	if !a.ok || !b.ok || events <= 0 {
		return nil
	}
	per := func(d time.Duration) float64 { return round(float64(d.Microseconds()) / float64(events)) }
	return map[string]float64{
		"postgresql_us":    per(b.postgres - a.postgres),
		"rabbitmq_us":      per(b.rabbitmq - a.rabbitmq),
		"bench_process_us": per(b.self - a.self),
	}
}

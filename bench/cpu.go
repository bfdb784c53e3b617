package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// The CPU instrument. A relay figure's events/s is bounded by CPU on a small
// machine, and events/s moves with whatever else runs there; the CPU time
// each party spends per event moves much less. Over a measured interval the
// benchmark reads the CPU time (user + system) of three process groups:
//
//   - relay: the benchmark's own process (getrusage), where the relays under
//     test, and the raw publisher of the baseline, run as goroutines. The
//     process does nothing else while a drain is timed but count the hooks'
//     callbacks and time the relay's SQL.
//   - postgresql: the backends connected to the figure's own database and
//     the WAL senders of its slots, read from /proc/PID/stat;
//     pg_stat_activity and pg_replication_slots name them, once at each end
//     of the interval and every second between, so that a backend that exits
//     during it counts up to its last reading. Other databases' backends and
//     WAL senders (other work on a shared server) are not.
//     The WAL senders are also read on their own (postgresql_walsender in
//     the details, a part of postgresql: the logical decoding of every
//     change of the server, the relay's own sweep included, against the
//     statements of the backends). The server's auxiliary processes
//     (checkpointer, WAL writer, background writer), which the whole server
//     shares, are read apart (postgresql_background in the details).
//   - rabbitmq: the broker's node, the process listening on the AMQP URL's
//     port (beam.smp). It serves every vhost and connection of the node: on
//     a shared broker the figure is an upper bound.
//
// The end-to-end figures also read the shipping process (shipping) and the
// FerretDB process it uses as its MongoDB (mongodb).
//
// A group whose server runs on another machine is not measured (its figures
// are left out and the details say why).

// clockTicks is USER_HZ, the unit of /proc/PID/stat's times: 100 on every
// Linux this runs on.
const clockTicks = 100

// procStat is what the instrument reads of one process in /proc/PID/stat.
type procStat struct {
	comm string
	// start is the process's start time in clock ticks after boot: a PID
	// reused by a new process between two readings has another.
	start uint64
	// cpu is utime + stime.
	cpu time.Duration
}

// parseProcStat parses the text of /proc/PID/stat. The command name is the
// text between the first '(' and the last ')': it may hold spaces and
// parentheses.
func parseProcStat(s string) (procStat, error) {
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return procStat{}, fmt.Errorf("no command name in %q", truncate(s, 60))
	}
	// After the name: state (3), ... utime (14), stime (15), ... starttime
	// (22), numbered as proc(5) numbers them; fields[0] is the state.
	fields := strings.Fields(s[end+1:])
	if len(fields) < 20 {
		return procStat{}, fmt.Errorf("%d fields after the command name, want at least 20", len(fields))
	}
	var n [3]uint64
	for i, f := range []int{11, 12, 19} {
		v, err := strconv.ParseUint(fields[f], 10, 64)
		if err != nil {
			return procStat{}, fmt.Errorf("field %d: %w", f+3, err)
		}
		n[i] = v
	}
	return procStat{
		comm:  s[open+1 : end],
		start: n[2],
		cpu:   time.Duration(n[0]+n[1]) * time.Second / clockTicks,
	}, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// readProcStat reads /proc/PID/stat under root (normally "/proc").
func readProcStat(root string, pid int) (procStat, error) {
	return readProcFile(root, pid, "stat", parseProcStat)
}

// readProcFile reads /proc/PID/name under root and parses it.
func readProcFile[T any](root string, pid int, name string, parse func(string) (T, error)) (T, error) {
	var zero T
	b, err := os.ReadFile(filepath.Join(root, strconv.Itoa(pid), name))
	if err != nil {
		return zero, err
	}
	v, err := parse(string(b))
	if err != nil {
		return zero, fmt.Errorf("pid %d: %w", pid, err)
	}
	return v, nil
}

// attributeCPU returns the CPU time the processes of one group spent over an
// interval read as samples: the first at its start, the last at its end, any
// others between. Each process (a PID with its start time: a PID reused by a
// new process is another) counts from its reading at the start, or whole if
// it was not there (it started during the interval), up to its last reading.
// A process that exits between two readings keeps what it spent up to the
// earlier; exited counts the processes missing from the last sample, whose
// CPU after their last reading is missing from the sum.
func attributeCPU(samples []map[int]procStat) (d time.Duration, exited int) {
	if len(samples) == 0 {
		return 0, 0
	}
	type proc struct {
		pid   int
		start uint64
	}
	last := map[proc]time.Duration{}
	for _, s := range samples {
		for pid, st := range s {
			k := proc{pid, st.start}
			last[k] = max(last[k], st.cpu)
		}
	}
	first, end := samples[0], samples[len(samples)-1]
	for k, cpu := range last {
		if begin, ok := first[k.pid]; ok && begin.start == k.start {
			cpu -= begin.cpu
		}
		d += cpu
		if st, ok := end[k.pid]; !ok || st.start != k.start {
			exited++
		}
	}
	return d, exited
}

// selfCPU is the CPU time (user + system) this process has spent so far.
func selfCPU() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, fmt.Errorf("getrusage: %w", err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}

// parseListeners returns the socket inodes listening on port in the text of
// /proc/net/tcp or /proc/net/tcp6.
func parseListeners(r io.Reader, port int) ([]uint64, error) {
	const listen = "0A"
	var inodes []uint64
	sc := bufio.NewScanner(r)
	for first := true; sc.Scan(); first = false {
		f := strings.Fields(sc.Text())
		if first || len(f) < 10 { // the header line
			continue
		}
		colon := strings.LastIndexByte(f[1], ':')
		if colon < 0 || f[3] != listen {
			continue
		}
		p, err := strconv.ParseUint(f[1][colon+1:], 16, 16)
		if err != nil {
			return nil, fmt.Errorf("local address %q: %w", f[1], err)
		}
		if int(p) != port {
			continue
		}
		inode, err := strconv.ParseUint(f[9], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("inode %q: %w", f[9], err)
		}
		inodes = append(inodes, inode)
	}
	return inodes, sc.Err()
}

// listenerPID returns the PID of the process listening on the TCP port:
// the socket's inode from /proc/net/tcp{,6}, then the process holding a
// descriptor of it. Reading other processes' descriptors needs the same
// user or root.
func listenerPID(root string, port int) (int, error) {
	var inodes []uint64
	for _, name := range []string{"net/tcp", "net/tcp6"} {
		f, err := os.Open(filepath.Join(root, name))
		if err != nil {
			continue // no IPv6
		}
		in, err := parseListeners(f, port)
		_ = f.Close()
		if err != nil {
			return 0, fmt.Errorf("%s: %w", name, err)
		}
		inodes = append(inodes, in...)
	}
	if len(inodes) == 0 {
		return 0, fmt.Errorf("no socket listens on port %d here", port)
	}
	want := map[string]bool{}
	for _, in := range inodes {
		want[fmt.Sprintf("socket:[%d]", in)] = true
	}
	dirs, err := filepath.Glob(filepath.Join(root, "[0-9]*"))
	if err != nil {
		return 0, err
	}
	for _, dir := range dirs {
		pid, err := strconv.Atoi(filepath.Base(dir))
		if err != nil {
			continue
		}
		fds, err := os.ReadDir(filepath.Join(dir, "fd"))
		if err != nil {
			continue // exited, or not ours to read
		}
		for _, fd := range fds {
			if link, err := os.Readlink(filepath.Join(dir, "fd", fd.Name())); err == nil && want[link] {
				return pid, nil
			}
		}
	}
	return 0, fmt.Errorf("no process readable here holds the socket listening on port %d", port)
}

// cpuGroups are the process groups read from /proc, in the order figures list them.
var cpuGroups = []string{"postgresql", "rabbitmq", "shipping", "mongodb", "postgresql_background", "postgresql_walsender"}

// partGroups are the groups read apart from the total: the server's shared
// background, and the part of postgresql that is its WAL senders.
var partGroups = []string{"postgresql_background", "postgresql_walsender"}

// cpuSample is one reading of every group.
type cpuSample struct {
	self  time.Duration
	procs map[string]map[int]procStat // group -> PID -> its stat
	// lsn is the server's WAL insert position (bytes), -1 where not read.
	lsn int64
}

// cpuUse is what each group spent over one measured interval.
type cpuUse struct {
	events int
	relay  time.Duration
	groups map[string]time.Duration // only the groups measured
	// gone counts the processes that exited during the interval (their CPU
	// after their last reading is missing).
	gone int
	// wal is the WAL the server wrote over the interval, in bytes, where
	// walRead. It is the whole server's: other databases' writes count too.
	wal     int64
	walRead bool
}

// perEvent returns the microseconds per event of each group measured, and
// their total (relay, postgresql, rabbitmq: the background processes are
// shared with the rest of the server and left out of it, the WAL senders are
// already in postgresql), and the WAL bytes per event (wal_bytes) where read.
func (u cpuUse) perEvent() map[string]float64 {
	if u.events <= 0 {
		return nil
	}
	per := func(d time.Duration) float64 { return round(float64(d.Nanoseconds()) / 1e3 / float64(u.events)) }
	m := map[string]float64{"relay": per(u.relay)}
	for g, d := range u.groups {
		m[g] = per(d)
	}
	m["total"] = per(u.total())
	if u.walRead {
		m["wal_bytes"] = round(float64(u.wal) / float64(u.events))
	}
	if u.gone > 0 {
		m["processes_exited"] = float64(u.gone)
	}
	return m
}

// total is what the relay and the groups spent, the groups read apart left
// out (partGroups).
func (u cpuUse) total() time.Duration {
	t := u.relay
	for g, d := range u.groups {
		if !slices.Contains(partGroups, g) {
			t += d
		}
	}
	return t
}

// cpuMeter reads the groups for one figure: its database's backends, the
// server's auxiliary processes and the broker's node.
type cpuMeter struct {
	pool      *pgxpool.Pool // on the figure's database
	procRoot  string
	rabbitPID int
	// shippingPID is the shipping service's process when the figure runs
	// one (e2e_latency): its own group, "shipping".
	shippingPID int
	// mongoPID is the FerretDB process shipping uses when the figure runs
	// one apart: its own group, "mongodb".
	mongoPID   int
	profileDir string // BENCH_CPUPROFILE: a CPU profile of this process per interval
	// unmeasured says why a group is not measured.
	unmeasured map[string]string
}

// newCPUMeter prepares the readings for a figure on pool's database and the
// broker at amqpURL ("" for a figure without RabbitMQ: no rabbitmq group).
// A server on another machine leaves its groups out.
func newCPUMeter(ctx context.Context, pool *pgxpool.Pool, amqpURL, profileDir string) *cpuMeter {
	m := &cpuMeter{pool: pool, procRoot: "/proc", profileDir: profileDir, unmeasured: map[string]string{}}
	var pid int
	if err := pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		m.unmeasured["postgresql"] = err.Error()
	} else if st, err := readProcStat(m.procRoot, pid); err != nil || st.comm != "postgres" {
		m.unmeasured["postgresql"] = fmt.Sprintf("backend %d is not a postgres process on this machine (%v)", pid, err)
	}
	if reason, ok := m.unmeasured["postgresql"]; ok {
		m.unmeasured["postgresql_background"] = reason
	}
	if amqpURL == "" {
		return m
	}
	if pid, err := brokerPID(m.procRoot, amqpURL); err != nil {
		m.unmeasured["rabbitmq"] = err.Error()
	} else {
		m.rabbitPID = pid
	}
	return m
}

// brokerPID finds the node serving amqpURL when its host is this machine.
func brokerPID(procRoot, amqpURL string) (int, error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return 0, fmt.Errorf("parse AMQP URL: %w", err)
	}
	host, port := u.Hostname(), 5672
	if p := u.Port(); p != "" {
		if port, err = strconv.Atoi(p); err != nil {
			return 0, fmt.Errorf("AMQP port %q: %w", p, err)
		}
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return 0, fmt.Errorf("the broker %s is not on this machine's loopback", host)
	}
	pid, err := listenerPID(procRoot, port)
	if err != nil {
		return 0, err
	}
	st, err := readProcStat(procRoot, pid)
	if err != nil {
		return 0, err
	}
	if st.comm != "beam.smp" {
		return 0, fmt.Errorf("port %d is served by %q (pid %d), not a RabbitMQ node", port, st.comm, pid)
	}
	return pid, nil
}

// procsQuery lists the PostgreSQL processes the meter reads, whether each
// is the figure's database's (a backend connected to it, or the WAL sender of
// one of its slots) or one of the server's auxiliary processes, and whether
// it is such a WAL sender. Other databases' backends and other WAL senders
// are left out.
const procsQuery = `SELECT a.pid, a.datname IS NOT DISTINCT FROM current_database() OR s.slot_name IS NOT NULL, s.slot_name IS NOT NULL
	FROM pg_stat_activity a
	LEFT JOIN pg_replication_slots s ON s.active_pid = a.pid AND s.database = current_database()
	WHERE a.datname = current_database() OR s.slot_name IS NOT NULL
		OR (a.datname IS NULL AND a.backend_type NOT IN ('client backend', 'walsender'))`

// sample reads every group: the servers' processes first and this process
// last at the start of an interval (first at its end, reverse), so that the
// reading's own work is outside it.
func (m *cpuMeter) sample(ctx context.Context, end bool) (cpuSample, error) {
	s := cpuSample{lsn: -1}
	var err error
	if _, skip := m.unmeasured["postgresql"]; !skip {
		if s.lsn, err = walPosition(ctx, m.pool); err != nil {
			return s, err
		}
	}
	if end {
		if s.self, err = selfCPU(); err != nil {
			return s, err
		}
	}
	if s.procs, err = m.readProcs(ctx); err != nil {
		return s, err
	}
	if !end {
		if s.self, err = selfCPU(); err != nil {
			return s, err
		}
	}
	return s, nil
}

// readProcs reads the processes of every group measured. A PostgreSQL
// process that exits between the listing and its reading is left out.
func (m *cpuMeter) readProcs(ctx context.Context) (map[string]map[int]procStat, error) {
	procs := map[string]map[int]procStat{}
	if _, skip := m.unmeasured["postgresql"]; !skip {
		rows, err := m.pool.Query(ctx, procsQuery)
		if err != nil {
			return nil, fmt.Errorf("list the PostgreSQL processes: %w", err)
		}
		for _, g := range []string{"postgresql", "postgresql_background", "postgresql_walsender"} {
			procs[g] = map[int]procStat{}
		}
		for rows.Next() {
			var pid int
			var ours, walSender bool
			if err := rows.Scan(&pid, &ours, &walSender); err != nil {
				rows.Close()
				return nil, err
			}
			st, err := readProcStat(m.procRoot, pid)
			if err != nil {
				continue
			}
			switch {
			case !ours:
				procs["postgresql_background"][pid] = st
			case walSender:
				procs["postgresql_walsender"][pid] = st
				fallthrough
			default:
				procs["postgresql"][pid] = st
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("list the PostgreSQL processes: %w", err)
		}
	}
	for _, p := range []struct {
		group string
		pid   int
	}{{"rabbitmq", m.rabbitPID}, {"shipping", m.shippingPID}, {"mongodb", m.mongoPID}} {
		if p.pid == 0 {
			continue
		}
		st, err := readProcStat(m.procRoot, p.pid)
		if err != nil {
			return nil, fmt.Errorf("read the %s process: %w", p.group, err)
		}
		procs[p.group] = map[int]procStat{p.pid: st}
	}
	return procs, nil
}

// cpuReadEvery is how often an interval reads the processes between its ends.
const cpuReadEvery = time.Second

// cpuInterval is one measured interval in progress: its first reading, and
// those a goroutine takes every cpuReadEvery until stop, so that a backend
// that exits during the interval counts up to its last reading.
type cpuInterval struct {
	m       *cpuMeter
	begin   cpuSample
	profile *os.File

	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	mid    []map[string]map[int]procStat // under mu
}

// start begins an interval; label names its profile file
// (BENCH_CPUPROFILE/label.pprof).
func (m *cpuMeter) start(ctx context.Context, label string) (*cpuInterval, error) {
	iv := &cpuInterval{m: m}
	if m.profileDir != "" {
		f, err := os.Create(filepath.Join(m.profileDir, label+".pprof"))
		if err != nil {
			return nil, fmt.Errorf("CPU profile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			_ = f.Close()
			return nil, fmt.Errorf("CPU profile: %w", err)
		}
		iv.profile = f
	}
	var err error
	if iv.begin, err = m.sample(ctx, false); err != nil {
		_ = iv.stopProfile()
		return nil, err
	}
	sctx, cancel := context.WithCancel(ctx)
	iv.cancel, iv.done = cancel, make(chan struct{})
	go func() {
		defer close(iv.done)
		t := time.NewTicker(cpuReadEvery)
		defer t.Stop()
		for {
			select {
			case <-sctx.Done():
				return
			case <-t.C:
			}
			// A failed reading between the ends loses nothing but its
			// precision: the end's reading decides.
			if procs, err := m.readProcs(sctx); err == nil {
				iv.mu.Lock()
				iv.mid = append(iv.mid, procs)
				iv.mu.Unlock()
			}
		}
	}()
	return iv, nil
}

func (iv *cpuInterval) stopProfile() error {
	if iv.profile == nil {
		return nil
	}
	pprof.StopCPUProfile()
	err := iv.profile.Close()
	iv.profile = nil
	return err
}

// stop ends the interval over which events events were handled.
func (iv *cpuInterval) stop(ctx context.Context, events int) (cpuUse, error) {
	iv.cancel()
	<-iv.done
	end, err := iv.m.sample(ctx, true)
	err = errors.Join(err, iv.stopProfile())
	if err != nil {
		return cpuUse{}, err
	}
	u := cpuUse{events: events, relay: end.self - iv.begin.self, groups: map[string]time.Duration{}}
	if end.lsn >= 0 && iv.begin.lsn >= 0 {
		u.wal, u.walRead = end.lsn-iv.begin.lsn, true
	}
	for _, g := range cpuGroups {
		b, ok := end.procs[g]
		if !ok {
			continue
		}
		samples := []map[int]procStat{iv.begin.procs[g]}
		for _, procs := range iv.mid {
			samples = append(samples, procs[g])
		}
		d, exited := attributeCPU(append(samples, b))
		u.groups[g] = d
		u.gone += exited
	}
	return u, nil
}

// cpuFigures returns the CPU per event of a relay figure, one figure per
// group and one for their total: the median over the repetitions of the
// relay's side against the median of the raw publisher's (the baseline of
// the events/s figure name), in µs per event.
func cpuFigures(name string, relay, raw []cpuUse, relayIs, rawIs string, unmeasured map[string]string) []Figure {
	var figs []Figure
	for _, g := range []string{"relay", "postgresql", "rabbitmq", "total"} {
		if _, ok := unmeasured[g]; ok {
			continue
		}
		if g == "total" && len(unmeasured) > 0 {
			continue // a total without a group would mislead
		}
		values, bases := perEventOf(relay, g), perEventOf(raw, g)
		if len(values) == 0 || len(bases) == 0 {
			continue
		}
		details := map[string]any{"per_rep": values, "baseline_per_rep": bases,
			"spread": spread(values), "baseline_spread": spread(bases)}
		if len(figs) == 0 && len(unmeasured) > 0 {
			details["unmeasured"] = unmeasured
		}
		figs = append(figs, newFigure(name+"_cpu_"+g, "us/event", median(values), median(bases), Goal{},
			"CPU time per event of "+cpuGroupText[g]+": "+relayIs+" (median of the repetitions)",
			"the same for "+rawIs, details))
	}
	if values, bases := perEventOf(relay, "wal_bytes"), perEventOf(raw, "wal_bytes"); len(values) > 0 && len(bases) > 0 {
		figs = append(figs, newFigure(name+"_wal_bytes", "bytes/event", median(values), median(bases), Goal{},
			"WAL the server wrote per event (pg_current_wal_insert_lsn at the interval's ends; the whole server's): "+relayIs+" (median of the repetitions)",
			"the same for "+rawIs, map[string]any{"per_rep": values, "baseline_per_rep": bases}))
	}
	return figs
}

var cpuGroupText = map[string]string{
	"relay":      "the relay (the benchmark's process, where it runs; getrusage)",
	"postgresql": "PostgreSQL (the backends of the figure's database, WAL sender included; /proc)",
	"rabbitmq":   "the RabbitMQ node (beam.smp; /proc; the whole node)",
	"total":      "the relay, PostgreSQL and RabbitMQ together",
}

// perEventOf returns group g's µs per event in each use that measured it.
func perEventOf(uses []cpuUse, g string) []float64 {
	var out []float64
	for _, u := range uses {
		if v, ok := u.perEvent()[g]; ok {
			out = append(out, v)
		}
	}
	return out
}

// spread returns the smallest and the largest of xs.
func spread(xs []float64) [2]float64 {
	if len(xs) == 0 {
		return [2]float64{}
	}
	return [2]float64{slices.Min(xs), slices.Max(xs)}
}

// schedStat is what /proc/PID/schedstat says of one process's main thread:
// the time it ran on a CPU and the time it waited on a run queue, both in
// nanoseconds. Unlike /proc/PID/stat's ticks of 10 ms it is exact, so it can
// tell apart blocks of a few milliseconds of one PostgreSQL backend (which
// has a single thread).
type schedStat struct {
	run, wait time.Duration
}

// parseSchedstat parses the text of /proc/PID/schedstat: three numbers, the
// time on a CPU (ns), the time waiting to run (ns), and the time slices run.
func parseSchedstat(s string) (schedStat, error) {
	f := strings.Fields(s)
	if len(f) < 2 {
		return schedStat{}, fmt.Errorf("schedstat %q: want at least two fields", truncate(s, 60))
	}
	var n [2]int64
	for i := range n {
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil || v < 0 {
			return schedStat{}, fmt.Errorf("schedstat field %d %q: not a count of nanoseconds", i+1, f[i])
		}
		n[i] = v
	}
	return schedStat{run: time.Duration(n[0]), wait: time.Duration(n[1])}, nil
}

// readSchedstat reads /proc/PID/schedstat under root (normally "/proc").
func readSchedstat(root string, pid int) (schedStat, error) {
	return readProcFile(root, pid, "schedstat", parseSchedstat)
}

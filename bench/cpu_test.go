package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// burnEnv makes the test binary a child that spends the CPU time it names
// (in milliseconds, measured by its own getrusage), says so on stdout and
// waits for its stdin to close.
const burnEnv = "BENCH_TEST_BURN_CPU_MS"

func TestMain(m *testing.M) {
	if v := os.Getenv(burnEnv); v != "" {
		os.Exit(burnCPU(v))
	}
	os.Exit(m.Run())
}

func burnCPU(v string) int {
	want, err := strconv.Atoi(v)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	x := uint64(1)
	for {
		for range 1_000_000 {
			x = x*6364136223846793005 + 1442695040888963407
		}
		spent, err := selfCPU()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		if spent >= time.Duration(want)*time.Millisecond {
			break
		}
	}
	fmt.Printf("burnt %d\n", x%2) // x printed so the loop is not optimised away
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	return 0
}

func TestParseProcStat(t *testing.T) {
	// A real line's layout; the command name may hold spaces and parentheses:
	// only the last ')' ends it. utime 250, stime 75 ticks, starttime 98765.
	line := "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 12 3 20 0 1 0 98765 1000 200 18446744073709551615\n"
	st, err := parseProcStat(line)
	if err != nil {
		t.Fatal(err)
	}
	if st.comm != "a (b) c" || st.cpu != 3250*time.Millisecond || st.start != 98765 {
		t.Fatalf("parseProcStat = %+v, want comm %q, cpu 3.25s, start 98765", st, "a (b) c")
	}
	for _, bad := range []string{
		"garbage",
		"4242 (postgres) S 1 2 3", // too short
		"4242 (postgres) S 1 4242 4242 0 -1 4194560 100 0 0 0 x 75 12 3 20 0 1 0 98765 1000", // utime not a number
	} {
		if _, err := parseProcStat(bad); err == nil {
			t.Errorf("parseProcStat(%q) accepted it", bad)
		}
	}
}

func TestAttributeCPU(t *testing.T) {
	a := map[int]procStat{
		10: {comm: "postgres", start: 500, cpu: 2 * time.Second},        // runs through the interval
		11: {comm: "postgres", start: 501, cpu: time.Second},            // exits during it
		12: {comm: "postgres", start: 502, cpu: 5 * time.Second},        // exits, and its PID is reused
		13: {comm: "postgres", start: 503, cpu: 100 * time.Millisecond}, // idle
	}
	b := map[int]procStat{
		10: {comm: "postgres", start: 500, cpu: 3500 * time.Millisecond},
		12: {comm: "postgres", start: 900, cpu: 300 * time.Millisecond}, // a new process: counts whole
		13: {comm: "postgres", start: 503, cpu: 100 * time.Millisecond},
		14: {comm: "postgres", start: 901, cpu: 200 * time.Millisecond}, // started during it (a WAL sender)
	}
	d, exited := attributeCPU([]map[int]procStat{a, b})
	if want := 1500*time.Millisecond + 300*time.Millisecond + 200*time.Millisecond; d != want || exited != 2 {
		t.Fatalf("two readings: %v, %d exited; want %v, 2 exited", d, exited, want)
	}

	// Readings between the ends: 11 and the first 12 are read again before
	// they exit, and 15 lives between two of them.
	mid1 := map[int]procStat{
		10: {start: 500, cpu: 2500 * time.Millisecond},
		11: {start: 501, cpu: 1400 * time.Millisecond},
		12: {start: 502, cpu: 5500 * time.Millisecond},
		15: {start: 600, cpu: 100 * time.Millisecond},
	}
	mid2 := map[int]procStat{
		10: {start: 500, cpu: 3 * time.Second},
		11: {start: 501, cpu: 1600 * time.Millisecond},
		15: {start: 600, cpu: 250 * time.Millisecond},
	}
	d, exited = attributeCPU([]map[int]procStat{a, mid1, mid2, b})
	// 10: 1.5 s; 11: 0.6 s to its last reading; old 12: 0.5 s; new 12: 0.3 s
	// whole; 13: 0; 14: 0.2 s whole; 15: 0.25 s whole.
	if want := 3350 * time.Millisecond; d != want || exited != 3 {
		t.Fatalf("four readings: %v, %d exited; want %v, 3 exited (11, the first 12, 15)", d, exited, want)
	}
	if d, exited := attributeCPU(nil); d != 0 || exited != 0 {
		t.Fatalf("attributeCPU of nothing = %v, %d", d, exited)
	}
	if d, exited := attributeCPU([]map[int]procStat{nil, nil}); d != 0 || exited != 0 {
		t.Fatalf("attributeCPU of empty readings = %v, %d", d, exited)
	}
}

func TestParseListeners(t *testing.T) {
	// /proc/net/tcp: 5672 (0x1628) listening on 127.0.0.1 and on 0.0.0.0, an
	// established connection to it (its local port is the client's, its
	// remote 5672), an established socket whose local port is 5672 (a served
	// connection, not a listener) and a listener on 5432 (0x1538).
	const tcp = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1628 00000000:0000 0A 00000000:00000000 00:00000000 00000000   106        0 7227 1 000000009e21e0ea 100 0 0 10 0
   1: 00000000:1628 00000000:0000 0A 00000000:00000000 00:00000000 00000000   106        0 7228 1 000000009e21e0ea 100 0 0 10 0
   2: 0100007F:D2F0 0100007F:1628 01 00000000:00000000 00:00000000 00000000     0        0 8001 1 000000002391c008 20 4 30 10 -1
   3: 0100007F:1628 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000   106        0 8002 1 000000002391c008 20 4 30 10 -1
   4: 0100007F:1538 00000000:0000 0A 00000000:00000000 00:00000000 00000000   104        0 6118 1 000000002391c008 100 0 0 10 0
`
	got, err := parseListeners(strings.NewReader(tcp), 5672)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != 7227 || got[1] != 7228 {
		t.Fatalf("listeners on 5672 = %v, want [7227 7228]", got)
	}
	const tcp6 = `  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1628 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000   106        0 9100 1 0000000000000000 100 0 0 10 0
`
	if got, err := parseListeners(strings.NewReader(tcp6), 5672); err != nil || len(got) != 1 || got[0] != 9100 {
		t.Fatalf("tcp6 listeners on 5672 = %v, %v; want [9100]", got, err)
	}
	if got, err := parseListeners(strings.NewReader(tcp), 15672); err != nil || len(got) != 0 {
		t.Fatalf("listeners on 15672 = %v, %v; want none", got, err)
	}
	if _, err := parseListeners(strings.NewReader("header\n 0: 0100007F:ZZZZ 00000000:0000 0A 0 0 0 0 0 1 1\n"), 5672); err == nil {
		t.Fatal("parseListeners accepted a port that is not hexadecimal")
	}
}

// TestReadProcStatOfABusyChild reads the real /proc of a child process that
// spent a known amount of CPU (by its own getrusage) and is still alive.
func TestReadProcStatOfABusyChild(t *testing.T) {
	const burn = 300 * time.Millisecond
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", burnEnv, burn.Milliseconds()))
	burnt := startBusyChild(t, cmd)
	before, err := readProcStat("/proc", cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	burnt()
	after, err := readProcStat("/proc", cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	// The kernel keeps the first 15 bytes of the executable's name.
	if want := truncateComm(os.Args[0]); after.comm != want {
		t.Errorf("comm = %q, want %q", after.comm, want)
	}
	if after.start != before.start || after.start == 0 {
		t.Errorf("start time %d then %d, want the same non-zero value", before.start, after.start)
	}
	// /proc counts in ticks of 10 ms, rounded down.
	if after.cpu < burn-time.Second/clockTicks {
		t.Errorf("/proc says the child spent %v, it measured at least %v itself", after.cpu, burn)
	}
	if d, exited := attributeCPU([]map[int]procStat{{cmd.Process.Pid: before}, {cmd.Process.Pid: after}}); d != after.cpu-before.cpu || exited != 0 {
		t.Errorf("attributeCPU = %v, %d exited; want %v, 0", d, exited, after.cpu-before.cpu)
	}
}

// startBusyChild starts cmd, a child that burns CPU, says "burnt" on its
// stdout and then waits for its stdin to close (which the test's cleanup
// does, then checks that it exited cleanly). It returns a function that
// waits for the "burnt" line.
func startBusyChild(t *testing.T, cmd *exec.Cmd) (burnt func()) {
	t.Helper()
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("child: %v", err)
		}
	})
	return func() {
		t.Helper()
		if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || !strings.HasPrefix(line, "burnt") {
			t.Fatalf("child said %q, %v", line, err)
		}
	}
}

func truncateComm(path string) string {
	name := path[strings.LastIndexByte(path, '/')+1:]
	if len(name) > 15 {
		name = name[:15]
	}
	return name
}

// TestListenerPIDFindsThisProcess finds the process listening on a port
// (this test's) as the instrument finds the RabbitMQ node, and refuses it as
// a broker: it is not beam.smp.
func TestListenerPIDFindsThisProcess(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	pid, err := listenerPID("/proc", port)
	if err != nil {
		t.Fatal(err)
	}
	if pid != os.Getpid() {
		t.Fatalf("listenerPID(%d) = %d, want this process, %d", port, pid, os.Getpid())
	}
	if _, err := brokerPID("/proc", fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)); err == nil || !strings.Contains(err.Error(), "not a RabbitMQ node") {
		t.Fatalf("brokerPID on a port this test serves: %v, want an error saying it is not a RabbitMQ node", err)
	}
	if _, err := brokerPID("/proc", "amqp://guest:guest@rabbit.example:5672/"); err == nil {
		t.Fatal("brokerPID accepted a broker on another machine")
	}
	ln.Close()
	if _, err := listenerPID("/proc", port); err == nil {
		t.Fatalf("listenerPID found a listener on port %d after it closed", port)
	}
}

func TestCPUPerEventAndFigures(t *testing.T) {
	use := func(relay, pg, rabbit time.Duration) cpuUse {
		return cpuUse{events: 100_000, relay: relay, groups: map[string]time.Duration{
			"postgresql": pg, "rabbitmq": rabbit, "postgresql_background": time.Second, "postgresql_walsender": pg / 2}}
	}
	u := use(2*time.Second, 3*time.Second, 5*time.Second)
	got := u.perEvent()
	// 2 s over 100,000 events is 20 µs; the background's 10 µs is not in the
	// total, nor the WAL senders' 15 µs, which are in postgresql's.
	if got["relay"] != 20 || got["postgresql"] != 30 || got["rabbitmq"] != 50 || got["postgresql_background"] != 10 || got["postgresql_walsender"] != 15 || got["total"] != 100 {
		t.Fatalf("perEvent = %v", got)
	}
	if (cpuUse{}).perEvent() != nil {
		t.Fatal("perEvent of no events should be nil")
	}

	relay := []cpuUse{use(2*time.Second, 3*time.Second, 5*time.Second), use(3*time.Second, 4*time.Second, 5*time.Second), use(4*time.Second, 2*time.Second, 6*time.Second)}
	raw := []cpuUse{use(time.Second, 0, 4*time.Second), use(time.Second, 0, 5*time.Second), use(2*time.Second, 0, 6*time.Second)}
	for i, w := range []int64{150e6, 120e6, 90e6} { // 1,500, 1,200 and 900 bytes per event
		relay[i].wal, relay[i].walRead = w, true
	}
	raw[0].wal, raw[0].walRead = 10e6, true // the others unread: their median is this one's
	figs := cpuFigures("relay_drain_x", relay, raw, "x", "raw", map[string]string{})
	byName := map[string]Figure{}
	for _, f := range figs {
		byName[f.Name] = f
		if f.Name == "relay_drain_x_wal_bytes" {
			if f.Unit != "bytes/event" || f.Value != 1200 || f.Baseline != 100 {
				t.Errorf("WAL figure %+v, want 1,200 against 100 bytes/event", f)
			}
			continue
		}
		if f.Unit != "us/event" || f.Met != nil {
			t.Errorf("%s: unit %q, met %v; want us/event and no goal", f.Name, f.Unit, f.Met)
		}
	}
	for name, want := range map[string][2]float64{
		"relay_drain_x_cpu_relay":      {30, 10},  // medians of 20,30,40 and 10,10,20
		"relay_drain_x_cpu_postgresql": {30, 0},   // 30,40,20
		"relay_drain_x_cpu_rabbitmq":   {50, 50},  // 50,50,60 and 40,50,60
		"relay_drain_x_cpu_total":      {120, 60}, // of the repetitions' totals, 100,120,120 and 50,60,80
	} {
		f, ok := byName[name]
		if !ok {
			t.Errorf("no figure %s in %v", name, figs)
			continue
		}
		if f.Value != want[0] || f.Baseline != want[1] {
			t.Errorf("%s = %v against %v, want %v against %v", name, f.Value, f.Baseline, want[0], want[1])
		}
	}
	if _, ok := byName["relay_drain_x_wal_bytes"]; !ok {
		t.Errorf("no WAL figure in %v", figs)
	}
	if s := byName["relay_drain_x_cpu_relay"].Details["spread"]; s != [2]float64{20, 40} {
		t.Errorf("relay spread = %v, want [20 40]", s)
	}

	// A group on another machine: its figure and the total are left out, and the details say why.
	noRabbit := []cpuUse{{events: 10, relay: time.Millisecond, groups: map[string]time.Duration{"postgresql": time.Millisecond}}}
	figs = cpuFigures("y", noRabbit, noRabbit, "x", "raw", map[string]string{"rabbitmq": "the broker is elsewhere"})
	if len(figs) != 2 || figs[0].Name != "y_cpu_relay" || figs[1].Name != "y_cpu_postgresql" || figs[0].Details["unmeasured"] == nil {
		t.Fatalf("figures without the broker: %+v", figs)
	}
}

func TestParseSchedstat(t *testing.T) {
	st, err := parseSchedstat("1339784 73860 2\n")
	if err != nil {
		t.Fatal(err)
	}
	if st.run != 1339784*time.Nanosecond || st.wait != 73860*time.Nanosecond {
		t.Fatalf("got %+v", st)
	}
	for _, bad := range []string{"", "12", "x 1 2", "1 -5 2"} {
		if _, err := parseSchedstat(bad); err == nil {
			t.Errorf("parseSchedstat(%q) accepted it", bad)
		}
	}
}

// TestReadSchedstatOfABusyChild reads the real schedstat of a
// single-threaded child (a shell's busy loop, as a PostgreSQL backend has one
// thread) after it spent some CPU: its time on a CPU agrees with what
// /proc/PID/stat counts in ticks.
func TestReadSchedstatOfABusyChild(t *testing.T) {
	cmd := exec.Command("sh", "-c", `i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo burnt; read x || true`)
	startBusyChild(t, cmd)()
	st, err := readSchedstat("/proc", cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	ps, err := readProcStat("/proc", cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if ps.cpu < 100*time.Millisecond {
		t.Fatalf("the child spent only %v: too little to compare with ticks of 10 ms", ps.cpu)
	}
	// Ticks are sampled: allow a few of them either way.
	if diff := (st.run - ps.cpu).Abs(); diff > 5*time.Second/clockTicks {
		t.Fatalf("schedstat says the child ran %v, /proc/PID/stat %v", st.run, ps.cpu)
	}
}

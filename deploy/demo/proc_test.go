package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The test binary doubles as the supervised process: with DEMO_TEST_CHILD set
// it behaves as the named child instead of running the tests.
func init() {
	switch os.Getenv("DEMO_TEST_CHILD") {
	case "":
		return
	case "graceful": // a service: runs until SIGTERM, then exits 0
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
		if armed := os.Getenv("DEMO_TEST_ARMED"); armed != "" {
			fmt.Println("child: armed with", armed)
		}
		fmt.Println("child: serving")
		<-sig
		fmt.Println("child: stopped")
		os.Exit(0)
	case "stubborn": // ignores SIGTERM
		signal.Ignore(syscall.SIGTERM)
		fmt.Println("child: ignoring SIGTERM")
		time.Sleep(time.Minute)
		os.Exit(0)
	case "crash": // dies at once
		fmt.Println("child: crashing")
		os.Exit(3)
	}
}

// syncBuffer is an io.Writer several goroutines write to.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func newTestProc(t *testing.T, child string, restart bool) (*proc, *syncBuffer, chan error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	out := &syncBuffer{}
	failed := make(chan error, 1)
	p := &proc{
		spec: procSpec{
			name:    child,
			path:    exe,
			args:    []string{"-test.run=^$"},
			env:     []string{"DEMO_TEST_CHILD=" + child},
			restart: restart,
		},
		out:     out,
		pidFile: t.TempDir() + "/" + child + ".pid",
		failed:  failed,
	}
	return p, out, failed
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func readPid(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

func alive(pid int) bool { return syscall.Kill(pid, 0) == nil }

// A process killed with SIGKILL comes back with a new pid (and pid file);
// stop then ends it with SIGTERM, cleanly, and removes the pid file.
func TestProcRestartsAKilledProcessAndStopsGracefully(t *testing.T) {
	t.Parallel()
	p, out, failed := newTestProc(t, "graceful", true)
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "first start", func() bool { return strings.Contains(out.String(), "child: serving") })
	first := p.pid()
	if got := readPid(t, p.pidFile); got != first {
		t.Fatalf("pid file says %d, process is %d", got, first)
	}

	if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "restart", func() bool { return p.pid() != first && strings.Count(out.String(), "child: serving") == 2 })
	second := p.pid()
	if got := readPid(t, p.pidFile); got != second {
		t.Fatalf("pid file says %d after restart, process is %d", got, second)
	}
	if !strings.Contains(out.String(), "died: signal: killed; restarting") {
		t.Fatalf("the restart was not reported:\n%s", out.String())
	}

	if err := p.stop(10 * time.Second); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if !strings.Contains(out.String(), "child: stopped") {
		t.Fatalf("the child did not get SIGTERM:\n%s", out.String())
	}
	if alive(second) {
		t.Fatalf("pid %d still alive after stop", second)
	}
	if _, err := os.Stat(p.pidFile); !os.IsNotExist(err) {
		t.Fatalf("pid file left behind: %v", err)
	}
	select {
	case err := <-failed:
		t.Fatalf("unexpected failure: %v", err)
	default:
	}
}

func TestProcKillsAProcessThatIgnoresSIGTERM(t *testing.T) {
	t.Parallel()
	p, out, _ := newTestProc(t, "stubborn", true)
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "start", func() bool { return strings.Contains(out.String(), "ignoring SIGTERM") })
	pid := p.pid()
	err := p.stop(300 * time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "did not stop within 300ms of SIGTERM; killed") {
		t.Fatalf("stop = %v, want the kill reported", err)
	}
	if alive(pid) {
		t.Fatalf("pid %d still alive", pid)
	}
}

func TestProcGivesUpOnACrashLoop(t *testing.T) {
	t.Parallel()
	p, out, failed := newTestProc(t, "crash", true)
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-failed:
		if !strings.Contains(err.Error(), "died 3 times in a row") || !strings.Contains(err.Error(), "exit status 3") {
			t.Fatalf("failure = %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("no failure reported for a crash loop:\n%s", out.String())
	}
	if err := p.stop(time.Second); err != nil {
		t.Fatalf("stop after giving up: %v", err)
	}
}

// A process that is not restarted (the load generator) is reported when it
// exits, and its exit is not a failure of the demo.
func TestProcNotRestartedIsReportedOnly(t *testing.T) {
	t.Parallel()
	p, out, failed := newTestProc(t, "crash", false)
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "exit report", func() bool { return strings.Contains(out.String(), "exit status 3; not restarted") })
	if err := p.stop(time.Second); err != nil {
		t.Fatalf("stop: %v", err)
	}
	select {
	case err := <-failed:
		t.Fatalf("unexpected failure: %v", err)
	default:
	}
}

// A held process stays down (no restart) until resumed; resumed with an
// environment, that incarnation alone gets it (the crash points of the live
// view), and the next one, after a death, runs without it.
func TestProcHoldKeepsItDownAndResumeArmsOneIncarnation(t *testing.T) {
	t.Parallel()
	p, out, failed := newTestProc(t, "graceful", true)
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "first start", func() bool { return strings.Contains(out.String(), "child: serving") })
	first := p.pid()
	if st := p.status(); st.State != procRunning || st.PID != first {
		t.Fatalf("status = %+v, want running with pid %d", st, first)
	}
	if err := p.resume(nil, ""); !errors.Is(err, errNotHeld) {
		t.Fatalf("resume of a running process = %v, want errNotHeld", err)
	}

	if err := p.hold(10 * time.Second); err != nil {
		t.Fatalf("hold: %v", err)
	}
	if alive(first) {
		t.Fatalf("pid %d alive after hold", first)
	}
	waitFor(t, "the stopped state", func() bool { return p.status().State == procStopped })
	time.Sleep(restartWait + 500*time.Millisecond) // longer than a restart would take
	if st := p.status(); st.State != procStopped || st.PID != 0 || strings.Count(out.String(), "child: serving") != 1 {
		t.Fatalf("a held process came back: %+v\n%s", st, out.String())
	}
	if err := p.hold(time.Second); err != nil {
		t.Fatalf("hold of a held process: %v", err)
	}

	if err := p.resume([]string{"DEMO_TEST_ARMED=yes"}, "armed for the test"); err != nil {
		t.Fatalf("resume: %v", err)
	}
	// Killed between its two lines, the armed child would never print
	// "serving": wait for both.
	waitFor(t, "the armed start", func() bool {
		return strings.Contains(out.String(), "child: armed with yes") && strings.Count(out.String(), "child: serving") == 2
	})
	armed := p.pid()
	if st := p.status(); st.Armed != "armed for the test" || st.State != procRunning {
		t.Fatalf("status = %+v, want running and armed", st)
	}
	if err := syscall.Kill(armed, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the restart after the armed one died", func() bool {
		return p.pid() != armed && p.pid() != 0 && strings.Count(out.String(), "child: serving") == 3
	})
	if strings.Count(out.String(), "child: armed with") != 1 || p.status().Armed != "" {
		t.Fatalf("the environment outlived its incarnation: %+v\n%s", p.status(), out.String())
	}
	if err := p.stop(10 * time.Second); err != nil {
		t.Fatalf("stop: %v", err)
	}
	select {
	case err := <-failed:
		t.Fatalf("unexpected failure: %v", err)
	default:
	}
}

// stop ends a held process's supervision too.
func TestProcStopWhileHeld(t *testing.T) {
	t.Parallel()
	p, out, _ := newTestProc(t, "graceful", true)
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "start", func() bool { return strings.Contains(out.String(), "child: serving") })
	if err := p.hold(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.stop(time.Second) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("stop: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("stop of a held process did not return")
	}
	if err := p.resume(nil, ""); err == nil {
		t.Fatal("resume after stop succeeded")
	}
}

package e2e

import (
	"bufio"
	"context"
	"io"
	"net"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// The harness's own parts, tested without the services.

func TestProcSupervisor(t *testing.T) {
	sleepBin, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	exited := make(chan exitEvent, 4)
	p, err := newProc(procSpec{name: "sleeper", bin: sleepBin, args: []string{"60"}}, t.TempDir(), func(ev exitEvent) {
		exited <- ev
	})
	if err != nil {
		t.Fatal(err)
	}
	p.restart = 10 * time.Millisecond
	defer p.close()

	first, err := p.start()
	if err != nil {
		t.Fatal(err)
	}
	// A kill the harness asked for is not reported and not restarted.
	if inc := p.kill(); inc != first {
		t.Fatalf("kill returned incarnation %v, want #%d", inc, first.n)
	}
	if p.current() != nil {
		t.Fatal("still running after kill")
	}
	if err := p.ensureRunning(); err != nil {
		t.Fatal(err)
	}
	second := p.current()
	if second == nil || second.n != 2 {
		t.Fatalf("after ensureRunning: %v", second)
	}

	// An exit nobody asked for is reported and the process restarted.
	_ = syscall.Kill(second.cmd.Process.Pid, syscall.SIGTERM)
	ev := <-exited
	if ev.incarnation != 2 || ev.crashPoint != "" {
		t.Errorf("exit event %+v", ev)
	}
	waitFor(t, func() bool { cur := p.current(); return cur != nil && cur.n == 3 })

	// An armed process that dies otherwise (here SIGTERM: a dependency down
	// at its start, say) comes back still armed.
	p.stop()
	armed, err := p.start("CRASH_POINT=test.point")
	if err != nil {
		t.Fatal(err)
	}
	_ = syscall.Kill(armed.cmd.Process.Pid, syscall.SIGTERM)
	if ev := <-exited; ev.crashPoint != "" {
		t.Errorf("exit event %+v: no crash point fired", ev)
	}
	waitFor(t, func() bool { cur := p.current(); return cur != nil && cur.n == armed.n+1 })
	if armed = p.current(); armed.point != "test.point" {
		t.Fatalf("restarted with point %q, want it still armed", armed.point)
	}

	// An armed process dying by SIGKILL died at its crash point.
	_ = syscall.Kill(armed.cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-armed.fired:
	case <-time.After(10 * time.Second):
		t.Fatal("crash point not reported")
	}
	if ev := <-exited; ev.crashPoint != "test.point" {
		t.Errorf("exit event %+v, want the crash point", ev)
	}
	waitFor(t, func() bool { cur := p.current(); return cur != nil && cur.n == armed.n+1 && cur.point == "" })

	if err := p.close(); err != nil {
		t.Fatal(err)
	}
	if p.current() != nil {
		t.Error("running after close")
	}
	if _, err := p.start(); err == nil {
		t.Error("start after close succeeded")
	}
}

func TestToxiproxyFaults(t *testing.T) {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer echo.Close()
	wg.Go(func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { defer c.Close(); _, _ = io.Copy(c, c) })
		}
	})

	x := newToxi()
	defer x.close()
	addr, err := x.add("echo", echo.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	roundTrip := func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Write([]byte("ping\n")); err != nil {
			return err
		}
		_, err = bufio.NewReader(c).ReadString('\n')
		return err
	}
	if err := roundTrip(); err != nil {
		t.Fatalf("through the proxy: %v", err)
	}

	if err := x.disable("echo"); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(); err == nil {
		t.Error("disabled proxy let a round trip through")
	}
	if err := x.enable("echo"); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(); err != nil {
		t.Fatalf("re-enabled proxy, same port: %v", err)
	}

	if err := x.addToxic("echo", "cut", "reset_peer", "upstream", map[string]any{"timeout": 0}); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(); err == nil {
		t.Error("reset_peer let a round trip through")
	}
	if err := x.addToxic("echo", "slow", "latency", "downstream", map[string]any{"latency": 300}); err != nil {
		t.Fatal(err)
	}
	if err := x.heal(t.Context()); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := roundTrip(); err != nil {
		t.Fatalf("after heal: %v", err)
	}
	if d := time.Since(start); d > 250*time.Millisecond {
		t.Errorf("latency toxic survived heal: round trip took %v", d)
	}
	if err := x.removeToxic(t.Context(), "echo", "gone"); err != nil {
		t.Errorf("removing a missing toxic: %v", err)
	}
	if err := x.disable("nope"); err == nil {
		t.Error("disable of an unknown proxy succeeded")
	}
}

func TestScrapeCounter(t *testing.T) {
	exposition := `# HELP shipping_events_duplicate_total Deliveries acked without a new effect.
# TYPE shipping_events_duplicate_total counter
shipping_events_duplicate_total{layer="inbox"} 7
shipping_events_duplicate_total{layer="version"} 2
shipping_events_duplicate_total_other 100
shipping_events_processed_total 40
`
	if v, ok := scrapeCounter(exposition, "shipping_events_duplicate_total"); !ok || v != 9 {
		t.Errorf("labelled counter: %v, %v; want 9, true", v, ok)
	}
	if v, ok := scrapeCounter(exposition, "shipping_events_processed_total"); !ok || v != 40 {
		t.Errorf("plain counter: %v, %v; want 40, true", v, ok)
	}
	if _, ok := scrapeCounter(exposition, "absent_total"); ok {
		t.Error("absent metric found")
	}
}

func TestWithVhost(t *testing.T) {
	tests := []struct{ in, host, vhost, want string }{
		{"amqp://guest:guest@127.0.0.1:5672/", "", "chaos_1", "amqp://guest:guest@127.0.0.1:5672/chaos_1"},
		{"amqp://guest:guest@127.0.0.1:5672/", "127.0.0.1:9999", "v", "amqp://guest:guest@127.0.0.1:9999/v"},
		{"amqp://u:p@h/old", "", "a/b", "amqp://u:p@h/a%2Fb"},
	}
	for _, tt := range tests {
		got, err := withVhost(tt.in, tt.host, tt.vhost)
		if err != nil || got != tt.want {
			t.Errorf("withVhost(%q, %q, %q) = %q, %v; want %q", tt.in, tt.host, tt.vhost, got, err, tt.want)
		}
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The run's own PostgreSQL keeps what was committed across an immediate stop
// (crash recovery), and comes back on the same port.
func TestOwnPostgresRestart(t *testing.T) {
	binDir, cred, err := ownPostgresBinDir()
	if err != nil {
		t.Skipf("no PostgreSQL cluster of our own here: %v", err)
	}
	pg, err := startOwnPostgres(t.Context(), binDir, cred, func(ev exitEvent) {
		t.Errorf("postgres exited on its own: %+v", ev)
	}, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := pg.close(); err != nil {
			t.Error(err)
		}
	}()
	run := func(sql string) {
		t.Helper()
		conn, err := pgx.Connect(t.Context(), pg.url("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(t.Context())
		if _, err := conn.Exec(t.Context(), sql); err != nil {
			t.Fatal(err)
		}
	}
	run(`CREATE TABLE kept (n int); INSERT INTO kept VALUES (42)`)

	if inc := pg.stopImmediately(); inc == nil {
		t.Fatal("postgres was not running")
	}
	if _, err := pgx.Connect(t.Context(), pg.url("postgres")); err == nil {
		t.Fatal("connected to a stopped server")
	}
	if err := pg.start(t.Context()); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(t.Context(), pg.url("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var n int
	if err := conn.QueryRow(t.Context(), `SELECT n FROM kept`).Scan(&n); err != nil || n != 42 {
		t.Fatalf("after the restart: n=%d, %v; want 42", n, err)
	}
}

// TestToxicRemovedWhileAConnectionCloses reproduces the toxiproxy deadlock
// removeToxic works around: a latency toxic removed from a busy connection
// whose client has just reset it. Toxiproxy then spends 5 s per chunk still
// queued, holding the lock every new connection needs. removeToxic must
// return promptly and the proxy must carry new connections right after.
func TestToxicRemovedWhileAConnectionCloses(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() { // a server that streams to each client until it goes away
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				chunk := make([]byte, 4096)
				for {
					if _, err := c.Write(chunk); err != nil {
						return
					}
					time.Sleep(time.Millisecond)
				}
			}()
		}
	}()
	x := newToxi()
	t.Cleanup(x.close)
	addr, err := x.add("stream", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if err := x.addToxic("stream", "slow", "latency", "downstream", map[string]any{"latency": 300}); err != nil {
		t.Fatal(err)
	}
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	_ = c.(*net.TCPConn).SetLinger(0)
	_ = c.Close() // a reset, with chunks still delayed in the toxic

	removed := make(chan error, 1)
	go func() { removed <- x.removeToxic(context.WithoutCancel(t.Context()), "stream", "slow") }()
	select {
	case err := <-removed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(4 * time.Second):
		t.Fatal("removing the toxic hangs (toxiproxy's lock held while it flushes a closed connection)")
	}
	c, err = net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatalf("a new connection after the removal: %v", err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 4096)); err != nil {
		t.Fatalf("a new connection after the removal carries nothing: %v", err)
	}
}

package e2e

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// procSpec describes one service process.
type procSpec struct {
	name string
	bin  string
	args []string
	env  []string // KEY=VALUE, on top of PATH, HOME and TMPDIR
	// readyURL answers 200 once the process serves, "" when it has no HTTP.
	readyURL string
	// cred runs the process as another user; nil runs it as the test's.
	cred *syscall.Credential
	// stopSignal asks for a graceful stop. Default: SIGTERM.
	stopSignal syscall.Signal
}

// incarnation is one run of a process, from start to exit.
type incarnation struct {
	n        int
	cmd      *exec.Cmd
	started  time.Time
	done     chan struct{} // closed when the process has exited and been reaped
	expected bool          // the harness asked it to exit (guarded by proc.mu)
	env      []string      // the extra environment it was started with
	point    string        // the armed crash point, "" when none
	fired    chan struct{} // closed when it died at its crash point
	state    *os.ProcessState
}

// exitEvent reports an exit the harness did not ask for.
type exitEvent struct {
	proc        string
	incarnation int
	at          time.Time
	crashPoint  string // set when the process died at its armed crash point
	status      string
	logTail     string // the last lines the incarnation wrote
}

// proc supervises one service process: it starts it, kills or stops it on
// request, and restarts it after an exit the harness did not ask for (a crash
// point firing, or a real crash), like an init system would.
type proc struct {
	spec    procSpec
	log     *os.File
	onExit  func(exitEvent) // called for every exit the harness did not ask for
	restart time.Duration   // delay before restarting after such an exit

	wg       sync.WaitGroup // watcher goroutines
	mu       sync.Mutex
	cur      *incarnation
	n        int
	closed   bool
	closedCh chan struct{}
}

func newProc(spec procSpec, logDir string, onExit func(exitEvent)) (*proc, error) {
	f, err := os.OpenFile(filepath.Join(logDir, spec.name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: open log: %w", spec.name, err)
	}
	return &proc{spec: spec, log: f, onExit: onExit, restart: 300 * time.Millisecond, closedCh: make(chan struct{})}, nil
}

// start starts a new incarnation with extra environment (a crash point).
func (p *proc) start(extraEnv ...string) (*incarnation, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.startLocked(extraEnv...)
}

func (p *proc) startLocked(extraEnv ...string) (*incarnation, error) {
	if p.closed {
		return nil, fmt.Errorf("%s: closed", p.spec.name)
	}
	if p.cur != nil && !isDone(p.cur.done) {
		return nil, fmt.Errorf("%s: already running (incarnation %d)", p.spec.name, p.cur.n)
	}
	p.n++
	inc := &incarnation{n: p.n, done: make(chan struct{}), fired: make(chan struct{}), env: extraEnv}
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "TMPDIR=" + os.TempDir()}
	env = append(append(env, p.spec.env...), extraEnv...)
	for _, kv := range extraEnv {
		if v, ok := cutPrefix(kv, "CRASH_POINT="); ok {
			inc.point = v
		}
	}
	cmd := exec.Command(p.spec.bin, p.spec.args...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = p.log, p.log
	// Own process group, so a signal meant for the test never reaches it; and
	// killed with the test binary, so a crashed run leaves no orphan behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL, Credential: p.spec.cred}
	fmt.Fprintf(p.log, "\n=== chaos: %s start #%d at %s %v\n", p.spec.name, inc.n, time.Now().Format(time.RFC3339Nano), extraEnv)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: start: %w", p.spec.name, err)
	}
	inc.cmd, inc.started = cmd, time.Now()
	p.cur = inc
	p.wg.Add(1)
	go p.watch(inc)
	return inc, nil
}

func cutPrefix(s, prefix string) (string, bool) {
	if len(s) >= len(prefix) && s[:len(prefix)] == prefix {
		return s[len(prefix):], true
	}
	return "", false
}

func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// watch reaps inc and, when nobody asked for its exit, reports it and
// restarts the process: unarmed after its crash point fired, else as it was
// (a process that failed at start while a dependency was down stays armed).
func (p *proc) watch(inc *incarnation) {
	defer p.wg.Done()
	_ = inc.cmd.Wait() // the exit status is in ProcessState
	inc.state = inc.cmd.ProcessState
	fmt.Fprintf(p.log, "=== chaos: %s #%d exited: %v at %s\n", p.spec.name, inc.n, inc.state, time.Now().Format(time.RFC3339Nano))
	p.mu.Lock()
	expected := inc.expected
	p.mu.Unlock()
	close(inc.done)
	if expected {
		return
	}
	ev := exitEvent{proc: p.spec.name, incarnation: inc.n, at: time.Now(), status: inc.state.String(), logTail: tail(p.log.Name(), 3)}
	restartEnv := inc.env
	if ws, ok := inc.state.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL && inc.point != "" {
		ev.crashPoint = inc.point
		close(inc.fired)
		restartEnv = nil
	}
	p.onExit(ev)
	t := time.NewTimer(p.restart)
	defer t.Stop()
	select {
	case <-p.closedCh:
		return
	case <-t.C:
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur == inc && !p.closed {
		if _, err := p.startLocked(restartEnv...); err != nil {
			fmt.Fprintf(p.log, "=== chaos: %s: restart failed: %v\n", p.spec.name, err)
		}
	}
}

// current returns the running incarnation, or nil.
func (p *proc) current() *incarnation {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur == nil || isDone(p.cur.done) {
		return nil
	}
	return p.cur
}

// signal asks the running incarnation to exit with sig and waits until it
// has; after grace it sends SIGKILL. It returns the incarnation that exited,
// or nil when none was running.
func (p *proc) signal(sig syscall.Signal, grace time.Duration) *incarnation {
	p.mu.Lock()
	inc := p.cur
	if inc == nil || isDone(inc.done) {
		p.mu.Unlock()
		return nil
	}
	inc.expected = true
	p.mu.Unlock()
	_ = inc.cmd.Process.Signal(sig)
	// A process a pause left stopped gets the signal only once it runs
	// again (SIGKILL excepted).
	_ = inc.cmd.Process.Signal(syscall.SIGCONT)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-inc.done:
	case <-t.C:
		_ = inc.cmd.Process.Kill()
		<-inc.done
	}
	return inc
}

// kill sends SIGKILL: no deferred function, no graceful shutdown.
func (p *proc) kill() *incarnation { return p.signal(syscall.SIGKILL, time.Minute) }

// stop asks for a graceful shutdown (SIGTERM unless the spec says
// otherwise), then kills after 15s.
func (p *proc) stop() *incarnation {
	return p.signal(cmp.Or(p.spec.stopSignal, syscall.SIGTERM), 15*time.Second)
}

// ensureRunning starts the process if no incarnation runs.
func (p *proc) ensureRunning() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur != nil && !isDone(p.cur.done) {
		return nil
	}
	_, err := p.startLocked()
	return err
}

// close stops the process for good and waits for its watchers.
func (p *proc) close() error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.closedCh)
	}
	p.mu.Unlock()
	p.stop()
	p.wg.Wait()
	return p.log.Close()
}

// waitReady polls the process's readiness URL until it answers 200.
func (p *proc) waitReady(ctx context.Context, timeout time.Duration) error {
	if p.spec.readyURL == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.spec.readyURL, nil)
		if err != nil {
			return fmt.Errorf("%s: readiness request: %w", p.spec.name, err)
		}
		req.Close = true // no idle connection outlives the check
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not ready at %s after %v: %w (see %s)", p.spec.name, p.spec.readyURL, timeout, last, p.log.Name())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// tail returns the last n lines of the file at path before the harness's
// own "=== chaos:" markers.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	var lines []string
	for _, line := range bytes.Split(bytes.TrimSpace(b), []byte("\n")) {
		if len(line) > 0 && !bytes.HasPrefix(line, []byte("=== chaos:")) {
			lines = append(lines, string(line))
		}
	}
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// logProblems returns the lines of the process's log that show a bug
// whatever the faults: a panic, a fatal runtime error, a data race.
func logProblems(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	var out []string
	for i, line := range bytes.Split(b, []byte("\n")) {
		for _, bad := range [][]byte{[]byte("panic: "), []byte("fatal error: "), []byte("WARNING: DATA RACE")} {
			if bytes.HasPrefix(line, bad) {
				out = append(out, filepath.Base(path)+":"+strconv.Itoa(i+1)+": "+string(line))
			}
		}
	}
	return out, nil
}

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// procSpec describes one supervised process.
type procSpec struct {
	name string
	path string
	args []string
	env  []string // added to the demo's own environment
	// ready returns nil once the process serves; nil means started is ready.
	ready func(ctx context.Context) error
	// restart brings the process back when it dies on its own.
	restart bool
	// keep, when set, filters the process's output lines (see prefixer).
	keep func(line []byte) bool
}

// proc runs a procSpec: it starts the process, restarts it when it dies
// (if the spec says so), and stops it on request.
type proc struct {
	spec    procSpec
	out     io.Writer
	pidFile string
	// failed receives an error when a restarted process dies too often or
	// cannot be started again.
	failed chan<- error

	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{} // closed when cmd has been waited for
	stopping bool
	stopCh   chan struct{} // closed by stop
	done     chan struct{} // closed when the supervising goroutine ends

	// held is set by hold: the process was stopped on purpose and stays
	// down until resume closes resumeCh.
	held     bool
	resumeCh chan struct{}
	// nextEnv and nextArmed are added to the next incarnation only (a crash
	// point armed for one run); armed describes the current one's.
	nextEnv   []string
	nextArmed string
	armed     string
	state     string // procRunning, procRestarting, procStopped or procExited
	since     time.Time
	restarts  int
	lastExit  string
}

// The states of a supervised process, as the live view shows them.
const (
	procRunning    = "running"
	procRestarting = "restarting"
	procStopped    = "stopped"
	procExited     = "exited"
)

// procStatus is a snapshot of a proc for the live view.
type procStatus struct {
	Name     string    `json:"name"`
	State    string    `json:"state"`
	PID      int       `json:"pid,omitempty"`
	Since    time.Time `json:"since"`
	Restarts int       `json:"restarts"`
	Armed    string    `json:"armed,omitempty"`
	LastExit string    `json:"last_exit,omitempty"`
	// Health is a compose container's healthcheck status ("" for a local
	// process, whose /readyz the live view probes itself).
	Health string `json:"health,omitempty"`
}

// crashLoop is how many quick deaths in a row make the demo give up on a
// process; quick means within crashWindow of its start.
const (
	crashLoop   = 3
	crashWindow = 5 * time.Second
	restartWait = time.Second
)

// start starts the process and supervises it in a goroutine until stop.
func (p *proc) start() error {
	p.done = make(chan struct{})
	p.stopCh = make(chan struct{})
	if err := p.spawn(); err != nil {
		close(p.done)
		return err
	}
	go p.supervise()
	return nil
}

// spawn starts one incarnation of the process.
func (p *proc) spawn() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping {
		return errors.New("stopping")
	}
	if p.held {
		return errors.New("held")
	}
	cmd := exec.Command(p.spec.path, p.spec.args...)
	cmd.Env = append(append(os.Environ(), p.spec.env...), p.nextEnv...)
	cmd.Stdout = p.out
	cmd.Stderr = p.out
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.spec.name, err)
	}
	p.cmd = cmd
	p.exited = make(chan struct{})
	p.armed, p.nextEnv, p.nextArmed = p.nextArmed, nil, ""
	p.state, p.since = procRunning, time.Now()
	if p.pidFile != "" {
		_ = os.WriteFile(p.pidFile, []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o644)
	}
	return nil
}

func (p *proc) supervise() {
	defer close(p.done)
	quick := 0
	for {
		p.mu.Lock()
		cmd, exited, started := p.cmd, p.exited, p.since
		p.mu.Unlock()
		err := cmd.Wait()
		close(exited)

		status := "exited"
		if err != nil {
			status = err.Error()
		}
		p.mu.Lock()
		stopping, held := p.stopping, p.held
		p.lastExit, p.since = status, time.Now()
		p.mu.Unlock()
		if stopping {
			return
		}
		if !held {
			if !p.spec.restart {
				p.setState(procExited)
				fmt.Fprintf(p.out, "demo: %s (pid %d) %s; not restarted\n", p.spec.name, cmd.Process.Pid, status)
				return
			}
			if time.Since(started) < crashWindow {
				quick++
			} else {
				quick = 0
			}
			if quick >= crashLoop {
				p.setState(procExited)
				p.failed <- fmt.Errorf("%s died %d times in a row within %s of starting (last: %s)", p.spec.name, quick, crashWindow, status)
				return
			}
			p.setState(procRestarting)
			fmt.Fprintf(p.out, "demo: %s (pid %d) died: %s; restarting in %s\n", p.spec.name, cmd.Process.Pid, status, restartWait)
			select {
			case <-time.After(restartWait):
			case <-p.stopCh:
				return
			}
		}
		// Stopped on purpose (or while waiting to restart): stay down until
		// resumed.
		p.mu.Lock()
		resume := p.resumeCh
		if p.held {
			p.state = procStopped
		}
		p.mu.Unlock()
		if resume != nil {
			select {
			case <-resume:
				quick = 0
			case <-p.stopCh:
				return
			}
		}
		if err := p.spawn(); err != nil {
			if p.isStopping() {
				return
			}
			p.setState(procExited)
			p.failed <- err
			return
		}
		p.mu.Lock()
		p.restarts++
		armed := p.armed
		p.mu.Unlock()
		if armed != "" {
			fmt.Fprintf(p.out, "demo: %s started (pid %d), armed: %s\n", p.spec.name, p.pid(), armed)
		} else {
			fmt.Fprintf(p.out, "demo: %s restarted (pid %d)\n", p.spec.name, p.pid())
		}
	}
}

func (p *proc) setState(s string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.state = s
}

// status is a snapshot for the live view.
func (p *proc) status() procStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := procStatus{Name: p.spec.name, State: p.state, Since: p.since, Restarts: p.restarts, Armed: p.armed, LastExit: p.lastExit}
	if p.state == procRunning && p.cmd != nil && p.cmd.Process != nil {
		st.PID = p.cmd.Process.Pid
	}
	return st
}

// errNotHeld is resume's answer for a process that was not stopped with hold.
var errNotHeld = errors.New("not stopped")

// hold stops the process on purpose, as stop does, but keeps supervising
// it: it stays down until resume. Holding a process already held does
// nothing.
func (p *proc) hold(grace time.Duration) error {
	p.mu.Lock()
	if p.stopping || p.held {
		p.mu.Unlock()
		return nil
	}
	p.held = true
	p.resumeCh = make(chan struct{})
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	fmt.Fprintf(p.out, "demo: stopping %s (pid %d) on request; it stays down until started again\n", p.spec.name, cmd.Process.Pid)
	return terminate(p.spec.name, cmd, exited, grace)
}

// resume starts a held process again, with env added to this incarnation
// only; armed says what env arms (shown in the live view).
func (p *proc) resume(env []string, armed string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping {
		return errors.New("the demo is stopping")
	}
	if !p.held {
		return fmt.Errorf("%s: %w", p.spec.name, errNotHeld)
	}
	p.held = false
	p.nextEnv, p.nextArmed = env, armed
	close(p.resumeCh)
	p.resumeCh = nil
	return nil
}

// terminate sends SIGTERM, waits up to grace for exited, then kills; only
// that last resort is an error.
func terminate(name string, cmd *exec.Cmd, exited <-chan struct{}, grace time.Duration) error {
	select {
	case <-exited:
		return nil
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return nil
	case <-time.After(grace):
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("%s did not stop within %s of SIGTERM; killed", name, grace)
	}
}

func (p *proc) isStopping() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopping
}

// pid is the current incarnation's process id.
func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// running returns a channel closed when the current incarnation exits.
func (p *proc) running() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exited
}

// stop sends SIGTERM, waits up to grace for the process to exit, then kills
// it; only that last resort is an error.
func (p *proc) stop(grace time.Duration) error {
	p.mu.Lock()
	if !p.stopping {
		p.stopping = true
		close(p.stopCh)
	}
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil {
		return nil
	}
	defer func() {
		<-p.done
		if p.pidFile != "" {
			_ = os.Remove(p.pidFile)
		}
	}()
	select {
	case <-exited:
		return nil // it had already died; supervise reported it
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(grace):
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("%s did not stop within %s of SIGTERM; killed", p.spec.name, grace)
	}
	if st := cmd.ProcessState; st != nil && !st.Success() {
		// Worth a line (e.g. a process stopped while it was still starting),
		// not a failure of the demo.
		fmt.Fprintf(p.out, "demo: %s stopped with %s\n", p.spec.name, st)
	}
	return nil
}

func pidFilePath(stateDir, name string) string {
	return filepath.Join(stateDir, "run", name+".pid")
}

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
	cmd := exec.Command(p.spec.path, p.spec.args...)
	cmd.Env = append(os.Environ(), p.spec.env...)
	cmd.Stdout = p.out
	cmd.Stderr = p.out
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.spec.name, err)
	}
	p.cmd = cmd
	p.exited = make(chan struct{})
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
		cmd, exited := p.cmd, p.exited
		p.mu.Unlock()
		started := time.Now()
		err := cmd.Wait()
		close(exited)

		p.mu.Lock()
		stopping := p.stopping
		p.mu.Unlock()
		if stopping {
			return
		}
		status := "exited"
		if err != nil {
			status = err.Error()
		}
		if !p.spec.restart {
			fmt.Fprintf(p.out, "demo: %s (pid %d) %s; not restarted\n", p.spec.name, cmd.Process.Pid, status)
			return
		}
		if time.Since(started) < crashWindow {
			quick++
		} else {
			quick = 0
		}
		if quick >= crashLoop {
			p.failed <- fmt.Errorf("%s died %d times in a row within %s of starting (last: %s)", p.spec.name, quick, crashWindow, status)
			return
		}
		fmt.Fprintf(p.out, "demo: %s (pid %d) died: %s; restarting in %s\n", p.spec.name, cmd.Process.Pid, status, restartWait)
		select {
		case <-time.After(restartWait):
		case <-p.stopCh:
			return
		}
		if err := p.spawn(); err != nil {
			if p.isStopping() {
				return
			}
			p.failed <- err
			return
		}
		fmt.Fprintf(p.out, "demo: %s restarted (pid %d)\n", p.spec.name, p.pid())
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

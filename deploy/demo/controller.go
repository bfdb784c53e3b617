package main

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// processController is what the live view needs of whatever runs the
// system: the local supervisor (localController) or docker compose
// (composeController). The page's process cards and fault buttons go
// through it and nothing else.
type processController interface {
	// mode names what runs the processes, for the page and the notes.
	mode() string
	// processes lists the process cards, in the page's order.
	processes() []processInfo
	// statuses reads each process's state, in the same order.
	statuses(ctx context.Context) []procStatus
	// relays are the processes the "stop/start both relays" buttons act on.
	relays() []string
	// stop stops the named processes and keeps them down until start.
	stop(ctx context.Context, names ...string) error
	// start starts stopped processes again and returns those it started;
	// one already running is left alone.
	start(ctx context.Context, names ...string) ([]string, error)
	// arm restarts a process with a crash point armed for its next run
	// only; errUnsupported when the controller cannot.
	arm(ctx context.Context, name, point, what string) error
	// rabbitmqctl runs rabbitmqctl -q args on the broker and returns its
	// output.
	rabbitmqctl(ctx context.Context, args ...string) (string, error)
}

// errUnsupported marks an action the controller cannot do.
var errUnsupported = errors.New("not available")

// localController is the local supervisor's side of the live view: the
// demo's own processes, signals and rabbitmqctl on this machine.
type localController struct {
	procs []*proc
	grace time.Duration
}

func (c *localController) mode() string { return "local processes" }

var localStoppable = map[string]bool{"relay-1": true, "relay-2": true, "shipping": true}

func (c *localController) processes() []processInfo {
	var out []processInfo
	for _, p := range c.procs {
		out = append(out, processInfo{Name: p.spec.name, Role: roles[p.spec.name], Stoppable: localStoppable[p.spec.name]})
	}
	return out
}

func (c *localController) statuses(context.Context) []procStatus {
	out := make([]procStatus, len(c.procs))
	for i, p := range c.procs {
		out[i] = p.status()
	}
	return out
}

func (c *localController) relays() []string { return []string{"relay-1", "relay-2"} }

func (c *localController) proc(name string) (*proc, error) {
	if !localStoppable[name] {
		return nil, fmt.Errorf("%w: process %q: want one of relay-1, relay-2, shipping", errBadRequest, name)
	}
	for _, p := range c.procs {
		if p.spec.name == name {
			return p, nil
		}
	}
	return nil, fmt.Errorf("%w: no process %q", errBadRequest, name)
}

func (c *localController) stop(_ context.Context, names ...string) error {
	var ps []*proc
	for _, n := range names {
		p, err := c.proc(n)
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(ps))
	for i, p := range ps {
		wg.Go(func() { errs[i] = p.hold(c.grace) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (c *localController) start(_ context.Context, names ...string) ([]string, error) {
	var started []string
	for _, n := range names {
		p, err := c.proc(n)
		if err != nil {
			return started, err
		}
		if err := p.resume(nil, ""); err != nil {
			if errors.Is(err, errNotHeld) {
				continue
			}
			return started, err
		}
		started = append(started, n)
	}
	return started, nil
}

func (c *localController) arm(ctx context.Context, name, point, what string) error {
	p, err := c.proc(name)
	if err != nil {
		return err
	}
	if err := c.stop(ctx, name); err != nil {
		return err
	}
	return p.resume([]string{"CRASH_POINT=" + point, "CRASH_AFTER=1"}, what)
}

// rabbitmqctl runs this machine's rabbitmqctl (it needs root or the
// rabbitmq user).
func (c *localController) rabbitmqctl(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, "rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
	text := strings.TrimSpace(string(out))
	if err != nil {
		return "", fmt.Errorf("rabbitmqctl %s: %w: %s", args[0], err, text)
	}
	return text, nil
}

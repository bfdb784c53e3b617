package inbox

import (
	"context"
	"strconv"
)

// Step is a part of Process that Hooks observe.
type Step int

const (
	// StepCheck finds out whether the message is recorded already: the done
	// cache, then the lookup (ModeStandalone), the claim (with a Lease), or
	// in ModeTransaction the read of the record and the insert of the new
	// one in the attempt's transaction (one StepCheck per attempt). A
	// StepCheck that reports Duplicate is Process's last step: the handler
	// does not run.
	StepCheck Step = iota + 1
	// StepRecord records the message done once its handler returned nil: the
	// insert of the done record (ModeStandalone), its move into the buffer
	// (FlushInterval), turning the claim into done (a Lease), or the commit
	// of the transaction, with the handler's writes (ModeTransaction).
	StepRecord
)

func (s Step) String() string {
	switch s {
	case StepCheck:
		return "check"
	case StepRecord:
		return "record"
	default:
		return "Step(" + strconv.Itoa(int(s)) + ")"
	}
}

// StepResult is how a Step ended.
type StepResult struct {
	// Duplicate (StepCheck): the message was recorded done already.
	Duplicate bool
	// Cached (StepCheck): answered by the done cache, without a database
	// operation.
	Cached bool
	// Buffered (StepRecord): the record went into the buffer, to be written
	// by the flusher (FlushInterval).
	Buffered bool
	// Err is the step's failure (ErrInProgress for a live claim, a
	// database error, a transient transaction error that Process will
	// retry), nil if it succeeded.
	Err error
}

// Hooks observe the steps of Process, for example to trace each as a span
// (package inboxotel does that with OpenTelemetry). They see the steps
// only: the handler runs with the context Process was given (in
// ModeTransaction, that context carrying the session), never with a step's,
// so the caller wraps the handler itself to observe the effect. Each hook is
// optional. Hooks run on Process's goroutine, in its path: keep them cheap,
// and never block or panic in them. They change nothing in what Process
// does or returns.
type Hooks struct {
	// StartStep is called when a step of msgID's processing begins, with
	// the context Process was given. The context it returns is the step's:
	// the step's database operations use it (keep Process's deadline and
	// values in it: derive it from ctx), and EndStep receives it. Return ctx
	// itself to observe nothing.
	StartStep func(ctx context.Context, step Step, msgID string) context.Context
	// EndStep is called when the step ends, with the context StartStep
	// returned (ctx itself without StartStep).
	EndStep func(ctx context.Context, step Step, msgID string, r StepResult)
}

// startStep runs Hooks.StartStep.
func (in *Inbox) startStep(ctx context.Context, step Step, msgID string) context.Context {
	if in.hooks.StartStep == nil {
		return ctx
	}
	return in.hooks.StartStep(ctx, step, msgID)
}

// endStep runs Hooks.EndStep.
func (in *Inbox) endStep(ctx context.Context, step Step, msgID string, r StepResult) {
	if in.hooks.EndStep != nil {
		in.hooks.EndStep(ctx, step, msgID, r)
	}
}

package outboxwal_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxamqp"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// crashingRelayEnv, set to a crashingRelay as JSON, makes the test binary run
// runCrashingRelay instead of the tests (see TestMain).
const crashingRelayEnv = "OUTBOXWAL_TEST_CRASHING_RELAY"

// crashingRelay is what the relay process of
// TestRelayDeadLettersAnEventThatCrashesItsProcess runs on.
type crashingRelay struct {
	Schema, Slot, Exchange string
	MaxAttempts            int
	// PollWorkers is the workers of the polling relay the WAL relay runs for
	// the rows it hands over.
	PollWorkers int
}

// runCrashingRelay runs a WAL relay publishing to RabbitMQ through
// outboxamqp, whose routing-key function panics for the aggregate "poison"
// (a bug in user code, met only by that event): the panic kills the process,
// as it would a real relay's. It runs until SIGTERM and returns the exit code.
func runCrashingRelay() int {
	var c crashingRelay
	if err := json.Unmarshal([]byte(os.Getenv(crashingRelayEnv)), &c); err != nil {
		fmt.Fprintln(os.Stderr, "crashing relay:", err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pcfg, err := pgxpool.ParseConfig(outboxtest.DatabaseURL())
	if err != nil {
		fmt.Fprintln(os.Stderr, "crashing relay:", err)
		return 1
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = c.Schema
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "crashing relay:", err)
		return 1
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	pub, err := outboxamqp.NewPublisher(outboxamqp.Config{
		URL:      testAMQPURL(),
		Exchange: c.Exchange,
		RoutingKey: func(e outbox.Envelope) string {
			if e.AggregateID == "poison" {
				panic("routing key: assignment to entry in nil map")
			}
			// A broker a little slow to take each message: the events
			// beside the poison are still in flight when it kills the
			// process, if anything lets them be.
			time.Sleep(20 * time.Millisecond)
			return e.EventType
		},
		ReconnectMin: 20 * time.Millisecond,
		ReconnectMax: 200 * time.Millisecond,
		Logger:       log,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "crashing relay:", err)
		return 1
	}
	defer pub.Close()
	relay, err := outboxwal.NewRelay(pool, pub, outboxwal.Config{
		Slot: c.Slot, Publication: c.Slot, MaxAttempts: c.MaxAttempts, BatchSize: 100,
		StatusInterval: 100 * time.Millisecond, SweepInterval: 20 * time.Millisecond,
		TakeoverInterval: 100 * time.Millisecond,
		Poll: outbox.RelayConfig{
			Workers: c.PollWorkers, PollInterval: 50 * time.Millisecond, Lease: 2 * time.Second, PublishTimeout: time.Second,
			RetryBackoffMin: 10 * time.Millisecond, RetryBackoffMax: 50 * time.Millisecond,
		},
		Logger: log,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "crashing relay:", err)
		return 1
	}
	if err := relay.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "crashing relay:", err)
		return 1
	}
	return 0
}

// lockedBuffer is a bytes.Buffer a child process writes while the test reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// relayProcess is one run of runCrashingRelay.
type relayProcess struct {
	cmd    *exec.Cmd
	stderr *lockedBuffer
	done   chan error
}

func startRelayProcess(t *testing.T, c crashingRelay) *relayProcess {
	t.Helper()
	conf, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	p := &relayProcess{stderr: &lockedBuffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(os.Args[0])
	p.cmd.Env = append(os.Environ(), crashingRelayEnv+"="+string(conf))
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("relay process %d's log:\n%s", p.cmd.Process.Pid, p.stderr.String())
		}
		_ = p.cmd.Process.Kill()
		<-p.done
		p.done <- nil
	})
	return p
}

// An event whose publishing kills the relay process (a panic in user code, an
// out-of-memory on a huge payload) must not kill every relay after it
// forever, nor take the events in flight beside it down with it each time: a
// restarted relay records the attempts of the events its predecessor may have
// had in flight before it makes them, publishes alone the ones that were in
// flight at two stops in a row, and dead-letters the event once its attempts
// reach MaxAttempts, with a reason. Each relay here is a real process that
// dies of the panic.
//
// The events are streamed (the slot made with Prepare before they were
// written), or handed over to polling (written before the slot existed):
// then the polling relay the WAL relay runs publishes them, with several
// workers, and an event it publishes alone must be alone in the process, not
// beside another worker's alone event.
func TestRelayDeadLettersAnEventThatCrashesItsProcess(t *testing.T) {
	t.Run("streamed", func(t *testing.T) { testCrashLoop(t, true) })
	t.Run("handed over", func(t *testing.T) { testCrashLoop(t, false) })
}

func testCrashLoop(t *testing.T, streamed bool) {
	ctx := context.Background()
	pool := walPool(t)
	b := newBroker(t, "#")
	cfg := walConfig(t, pool)
	if streamed {
		// The slot first, so that every event below is in its stream.
		prep, err := outboxwal.NewRelay(pool, newPublisherForTest(t, b), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := prep.Prepare(ctx); err != nil {
			t.Fatal(err)
		}
	}

	var good []outbox.Message
	for i := range 10 {
		good = append(good, msg(fmt.Sprintf("good-%d", i), "order.created"))
	}
	goods := enqueue(t, pool, good...)
	poison := enqueue(t, pool, msg("poison", "order.created"), msg("poison", "order.cancelled"))
	good = good[:0]
	for i := range 10 {
		good = append(good, msg(fmt.Sprintf("good-%d", 10+i), "order.created"))
	}
	goods = append(goods, enqueue(t, pool, good...)...)

	const maxAttempts = 3
	c := crashingRelay{
		Schema:      pool.Config().ConnConfig.RuntimeParams["search_path"],
		Slot:        cfg.Slot,
		Exchange:    b.Exchange,
		MaxAttempts: maxAttempts,
		PollWorkers: 4,
	}
	deadLettered := func() bool {
		return count(t, pool, `SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL`) > 0
	}

	// Run relay processes one after the other, each replacing the one that
	// died, as a process supervisor would, until the poison is dead-lettered.
	crashes := 0
	var running *relayProcess
	var processes []*relayProcess
	for running == nil {
		if crashes > 2*maxAttempts {
			t.Fatalf("relays died %d times and the event is still published again", crashes)
		}
		p := startRelayProcess(t, c)
		processes = append(processes, p)
		deadline := time.After(60 * time.Second)
	wait:
		for {
			select {
			case err := <-p.done:
				p.done <- err
				var exit *exec.ExitError
				if !errors.As(err, &exit) || !strings.Contains(p.stderr.String(), "panic: routing key") {
					t.Fatalf("the relay process ended (%v) without the poison's panic:\n%s", err, p.stderr.String())
				}
				crashes++
				break wait
			case <-deadline:
				t.Fatalf("the relay process neither died nor dead-lettered the event in 60s:\n%s", p.stderr.String())
			case <-time.After(20 * time.Millisecond):
				if deadLettered() {
					running = p
					break wait
				}
			}
		}
	}
	t.Logf("relays died %d times before the event was dead-lettered", crashes)
	if streamed {
		for _, p := range processes {
			if log := p.stderr.String(); strings.Contains(log, "the rows in the outbox are handed over to polling") {
				t.Errorf("a relay handed events of the stream over to polling:\n%s", log)
			}
		}
	}
	if crashes < 1 || crashes > maxAttempts {
		t.Fatalf("relays died %d times, want 1 to MaxAttempts (%d)", crashes, maxAttempts)
	}

	// Dead-lettered with its attempts and the reason; its aggregate's next
	// event waits behind it, handed over to polling.
	outboxtest.WantCrashDeadLetter(t, pool, poison[0].ID, maxAttempts)
	waitFor(t, "the poison's next event parked behind the dead letter", 10*time.Second, func() (bool, error) {
		return count(t, pool, `SELECT count(*) FROM outbox WHERE id = $1 AND handed_over AND dead_lettered_at IS NULL`,
			poison[1].ID) == 1, nil
	})

	// Every other event was published, at most once by each relay (a
	// confirmed event whose row was not swept yet when its relay died is
	// published again), and the relay that dead-lettered the poison keeps
	// running and publishing.
	late := enqueue(t, pool, msg("late", "order.created"))
	got := b.waitIDs("every other event, and one written after", append(append([]outbox.Enqueued(nil), goods...), late...))
	checkAggregateOrder(t, got)
	seen := receivedIDs(got)
	for _, e := range goods {
		if seen[e.ID] > crashes+1 {
			t.Errorf("event %d delivered %d times by %d relays", e.ID, seen[e.ID], crashes+1)
		}
	}
	for _, e := range poison {
		if seen[e.ID] > 0 {
			t.Errorf("poison event %d was published", e.ID)
		}
	}
	waitFor(t, "the other events' rows swept", 10*time.Second, func() (bool, error) {
		return count(t, pool, `SELECT count(*) FROM outbox WHERE aggregate_id <> 'poison'`) == 0, nil
	})

	if err := running.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-running.done:
		running.done <- err
		if err != nil {
			t.Fatalf("the last relay process, stopped with SIGTERM: %v\n%s", err, running.stderr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the last relay process did not stop within 30s of SIGTERM")
	}
}

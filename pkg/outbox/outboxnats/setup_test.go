package outboxnats_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxnats"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// startServer runs a NATS server with JetStream in the test's process, on
// a free port, its store in a directory of the test's own; it is shut down
// when the test ends.
func startServer(t testing.TB) *server.Server {
	t.Helper()
	s, err := server.NewServer(&server.Options{
		Host:      "127.0.0.1",
		Port:      server.RANDOM_PORT,
		JetStream: true,
		StoreDir:  t.TempDir(),
		NoLog:     true,
		NoSigs:    true,
	})
	if err != nil {
		t.Fatalf("nats-server: %v", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		t.Fatal("nats-server not ready for connections within 10s")
	}
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	return s
}

func randomName(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// jetStream is a connection of the test's own to the server, closed when
// the test ends.
func jetStream(t testing.TB, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// newStream creates a stream of its own capturing subjects, returned with
// a reader of what it stores.
func newStream(t testing.TB, js jetstream.JetStream, cfg jetstream.StreamConfig) *streamReader {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if cfg.Name == "" {
		cfg.Name = randomName("outboxnats_test_")
	}
	st, err := js.CreateStream(ctx, cfg)
	if err != nil {
		t.Fatalf("create stream %s: %v", cfg.Name, err)
	}
	return &streamReader{st: st}
}

// streamReader reads a stream's messages in sequence order.
type streamReader struct {
	st   jetstream.Stream
	mu   sync.Mutex
	msgs []*jetstream.RawStreamMsg
	last uint64
}

// read returns every message the stream held at the call, from the first.
func (r *streamReader) read(ctx context.Context) ([]*jetstream.RawStreamMsg, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	info, err := r.st.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream info: %w", err)
	}
	for seq := r.last + 1; seq <= info.State.LastSeq; seq++ {
		m, err := r.st.GetMsg(ctx, seq)
		if err != nil {
			return nil, fmt.Errorf("get message %d: %w", seq, err)
		}
		r.msgs = append(r.msgs, m)
		r.last = seq
	}
	return append([]*jetstream.RawStreamMsg(nil), r.msgs...), nil
}

// waitMessages waits until the stream holds n messages, and returns them.
func (r *streamReader) waitMessages(t testing.TB, n int, timeout time.Duration) []*jetstream.RawStreamMsg {
	t.Helper()
	var got []*jetstream.RawStreamMsg
	outboxtest.WaitFor(t, fmt.Sprintf("%d messages in the stream", n), timeout, func() (bool, error) {
		var err error
		got, err = r.read(context.Background())
		return len(got) >= n, err
	})
	return got
}

func newPublisher(t testing.TB, url, prefix string) *outboxnats.Publisher {
	t.Helper()
	p, err := outboxnats.NewPublisher(outboxnats.Config{
		URL:           url,
		SubjectPrefix: prefix,
		DialTimeout:   2 * time.Second,
		ReconnectMin:  20 * time.Millisecond,
		ReconnectMax:  200 * time.Millisecond,
		Logger:        testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func testLogger(t testing.TB) *slog.Logger { return outboxtest.Logger(t) }

// ordered checks that msgs hold every event of the outbox rows enqueued,
// each aggregate's in version order, and returns how many copies there are.
func wantPerAggregateOrder(t testing.TB, msgs []*jetstream.RawStreamMsg, enqueued []outbox.Enqueued) {
	t.Helper()
	want := map[string]bool{}
	for _, e := range enqueued {
		want[outbox.MessageID(e.ID, e.CreatedAt)] = true
	}
	last := map[string]int64{}
	seen := map[string]bool{}
	for _, m := range msgs {
		id := m.Header.Get(jetstream.MsgIDHeader)
		if !want[id] {
			t.Errorf("stream message %d: id %q is no enqueued event", m.Sequence, id)
			continue
		}
		if seen[id] {
			t.Errorf("stream message %d: id %q stored twice", m.Sequence, id)
		}
		seen[id] = true
		agg := m.Header.Get("aggregate_id")
		var v int64
		if _, err := fmt.Sscan(m.Header.Get("aggregate_version"), &v); err != nil {
			t.Fatalf("stream message %d: aggregate_version %q", m.Sequence, m.Header.Get("aggregate_version"))
		}
		if v != last[agg]+1 {
			t.Errorf("aggregate %s: version %d stored after %d", agg, v, last[agg])
		}
		last[agg] = v
	}
	if len(seen) != len(want) {
		t.Errorf("the stream holds %d of the %d events", len(seen), len(want))
	}
}

package inbox

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
)

// warnings is a slog.Handler keeping the messages of warnings.
type warnings struct {
	mu   sync.Mutex
	msgs []string
}

func (w *warnings) Enabled(context.Context, slog.Level) bool { return true }
func (w *warnings) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.msgs = append(w.msgs, r.Message)
	}
	return nil
}
func (w *warnings) WithAttrs([]slog.Attr) slog.Handler { return w }
func (w *warnings) WithGroup(string) slog.Handler      { return w }

func TestLeaseIgnoredByAutoModeResolvingToTransactionsIsLogged(t *testing.T) {
	t.Parallel()
	client, err := mongo.Connect(options.Client().ApplyURI("mongodb://127.0.0.1:9")) // never dialled
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.Background()) })
	logs := &warnings{}
	in, err := New(client.Database("db"), Config{Consumer: "c", Lease: time.Minute, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	in.detect = func(context.Context, *mongo.Client) (Mode, error) { return ModeTransaction, nil } // a replica set
	if m, err := in.Mode(t.Context()); err != nil || m != ModeTransaction {
		t.Fatalf("Mode: %v, %v", m, err)
	}
	logs.mu.Lock()
	defer logs.mu.Unlock()
	if len(logs.msgs) != 1 || !strings.Contains(logs.msgs[0], "Lease") {
		t.Fatalf("warnings %q, want one saying Lease is ignored in transaction mode", logs.msgs)
	}
}

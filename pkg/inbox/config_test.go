package inbox

import (
	"context"
	"log/slog"
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

// ModeAuto takes the settings of the mode it finds, the others are not for
// that mode: nothing is "ignored with a warning". Standalone settings do not
// apply on a replica set, Transaction settings do not on a standalone
// server, and neither is warned about.
func TestAutoModeTakesTheSettingsOfTheModeItFinds(t *testing.T) {
	t.Parallel()
	client, err := mongo.Connect(options.Client().ApplyURI("mongodb://127.0.0.1:9")) // never dialled
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Disconnect(context.Background()) })
	for _, found := range []Mode{ModeTransaction, ModeStandalone} {
		t.Run(string(found), func(t *testing.T) {
			logs := &warnings{}
			in, err := New(client.Database("db"), Config{
				Consumer:    "c",
				Standalone:  StandaloneConfig{Lease: time.Minute},
				Transaction: TransactionConfig{RetryBudget: time.Minute, MaxAttempts: 3},
				Logger:      slog.New(logs),
			})
			if err != nil {
				t.Fatal(err)
			}
			in.detect = func(context.Context, *mongo.Client) (Mode, error) { return found, nil }
			if m, err := in.Mode(t.Context()); err != nil || m != found {
				t.Fatalf("Mode: %v, %v", m, err)
			}
			if in.lease != time.Minute || in.txBudget != time.Minute || in.maxAttempts != 3 {
				t.Fatalf("lease %v, budget %v, attempts %d: want each mode's settings kept for it", in.lease, in.txBudget, in.maxAttempts)
			}
			logs.mu.Lock()
			defer logs.mu.Unlock()
			if len(logs.msgs) != 0 {
				t.Fatalf("warnings %q, want none", logs.msgs)
			}
		})
	}
}

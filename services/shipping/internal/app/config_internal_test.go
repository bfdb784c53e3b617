package app

import (
	"context"
	"testing"
	"time"
)

// newUnstarted is an App that never runs: its HTTP listener and MongoDB
// client are released when the test ends.
func newUnstarted(t *testing.T, cfg Config) *App {
	t.Helper()
	cfg.AMQPURL = "amqp://guest:guest@127.0.0.1:9/"
	cfg.MongoURI = "mongodb://127.0.0.1:9"
	cfg.HTTPAddr = "127.0.0.1:0"
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = a.listener.Close()
		_ = a.client.Disconnect(context.Background())
	})
	return a
}

// Where MongoDB has no TTL index (FerretDB) each purge reads the whole inbox
// collection (pkg/inbox, Purge): the service purges hourly, as the inbox's
// documentation says.
func TestPurgeIntervalDefaultsToHourly(t *testing.T) {
	if got := newUnstarted(t, Config{}).cfg.PurgeInterval; got != time.Hour {
		t.Fatalf("default PurgeInterval %v, want 1h", got)
	}
	if got := newUnstarted(t, Config{PurgeInterval: time.Minute}).cfg.PurgeInterval; got != time.Minute {
		t.Fatalf("PurgeInterval %v, want the configured 1m", got)
	}
}

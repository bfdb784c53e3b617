// Package waltest holds the WAL relay's test helpers that the tests of
// outboxwal and of the publishers share: a slot and a publication of the
// test's own, and a relay that runs until the test ends. It is apart from
// outboxtest, which outboxwal's internal tests import.
package waltest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-inbox/reference/pkg/outbox"
	"github.com/outbox-inbox/reference/pkg/outbox/internal/outboxtest"
	"github.com/outbox-inbox/reference/pkg/outbox/outboxwal"
)

// SlotPrefix names the slots tests create. A slot left behind keeps WAL on
// the server forever, so outboxwal's TestMain drops the ones of earlier runs
// that died before their cleanup (their name says when they were made).
const SlotPrefix = "outboxwal_test_"

// LongWait bounds the waits for what a relay must do eventually: under load
// (tests of many packages at once, each decoding the others' writes) it can
// take minutes, and a wait that runs out is a failure, not a measure.
const LongWait = 5 * time.Minute

// RequireLogical skips the test (fails it under CI=true) unless the server
// runs with wal_level=logical.
func RequireLogical(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	var level string
	if err := pool.QueryRow(context.Background(), "SHOW wal_level").Scan(&level); err != nil {
		t.Fatal(err)
	}
	if level != "logical" {
		msg := fmt.Sprintf("the server runs with wal_level=%s; the WAL relay needs wal_level=logical "+
			"(ALTER SYSTEM SET wal_level = logical and a restart: .ci/run does it)", level)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
}

// Config returns a config with a slot and a publication of the test's own,
// both dropped when the test ends (after its relays stopped: register
// relays after calling this).
func Config(t testing.TB, pool *pgxpool.Pool) outboxwal.Config {
	t.Helper()
	name := fmt.Sprintf("%s%d_%s", SlotPrefix, time.Now().Unix(), randomHex(4))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for {
			err := outboxwal.Drop(ctx, pool, name, name)
			if err == nil {
				return
			}
			if ctx.Err() != nil {
				t.Errorf("drop slot %s: %v", name, err)
				return
			}
			time.Sleep(100 * time.Millisecond) // the walsender of a stopped relay is still exiting
		}
	})
	return outboxwal.Config{
		Slot:             name,
		Publication:      name,
		BatchSize:        100,
		PublishTimeout:   5 * time.Second,
		StatusInterval:   100 * time.Millisecond,
		SweepInterval:    20 * time.Millisecond,
		TakeoverInterval: 100 * time.Millisecond,
		Poll: outbox.RelayConfig{
			PollInterval:    50 * time.Millisecond,
			RetryBackoffMin: 10 * time.Millisecond,
			RetryBackoffMax: 50 * time.Millisecond,
		},
		Logger: outboxtest.Logger(t),
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Start runs a WAL relay until the test ends (or stop is called), and
// fails the test if Run returns an error or does not return within LongWait
// of being stopped.
func Start(t testing.TB, pool *pgxpool.Pool, pub outbox.Publisher, cfg outboxwal.Config) (r *outboxwal.Relay, stop func()) {
	t.Helper()
	relay, err := outboxwal.NewRelay(pool, pub, cfg)
	if err != nil {
		t.Fatalf("NewRelay: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(LongWait):
				t.Errorf("relay did not stop within %v of its context being cancelled", LongWait)
			}
		})
	}
	t.Cleanup(stop)
	return relay, stop
}

// WaitActive waits for r to stream from its slot. Creating a slot waits for
// every transaction running on the server to end (another test's bulk
// insert included), and the server may be slow: the wait is long, and says
// nothing of how fast a relay starts.
func WaitActive(t testing.TB, r *outboxwal.Relay) {
	t.Helper()
	outboxtest.WaitFor(t, "the relay streaming", LongWait, func() (bool, error) { return r.Stats().Active, nil })
}

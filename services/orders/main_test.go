package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-inbox/reference/services/orders/internal/postgres/pgtest"
)

// syncBuffer collects a process's logs written from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// newDatabaseURL names a database that does not exist yet, and drops it when
// the test ends.
func newDatabaseURL(t *testing.T) string {
	t.Helper()
	admin := pgtest.Connect(t)
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	name := "orders_run_" + hex.EncodeToString(b)
	cfg, err := pgx.ParseConfig(pgtest.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	return fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", cfg.User, cfg.Host, cfg.Port, name)
}

// With MIGRATE=true the service starts with nothing but a database URL: it
// creates the database and its schema, serves, and shuts down cleanly when its
// context ends.
func TestServeWithMigrateCreatesDatabaseServesAndStopsGracefully(t *testing.T) {
	dbURL := newDatabaseURL(t)
	addr := freeAddr(t)
	env := map[string]string{"DATABASE_URL": dbURL, "HTTP_ADDR": addr, "RELAY": "false", "MIGRATE": "true"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs syncBuffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, nil, func(k string) string { return env[k] }, &logs, &logs) }()

	base := "http://" + addr
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get(base + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("service not ready: %v\nlogs:\n%s", err, logs.String())
		}
		select {
		case err := <-done:
			t.Fatalf("run returned early: %v\nlogs:\n%s", err, logs.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	resp, err := http.Post(base+"/orders", "application/json",
		strings.NewReader(`{"customer_id": "c-42", "currency": "EUR", "items": [{"sku": "sku-1", "quantity": 2, "unit_price": 1250}]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 201 {
		t.Fatalf("create: %d", resp.StatusCode)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v\nlogs:\n%s", err, logs.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("run did not return after its context was cancelled")
	}
	if !strings.Contains(logs.String(), "shutting down") {
		t.Errorf("no shutdown log line:\n%s", logs.String())
	}
}

func TestRunRejectsBadConfigAndCommands(t *testing.T) {
	for name, tc := range map[string]struct {
		args []string
		env  map[string]string
	}{
		"unknown command":  {[]string{"frobnicate"}, nil},
		"bad batch size":   {nil, map[string]string{"RELAY_BATCH_SIZE": "-3"}},
		"bad interval":     {nil, map[string]string{"RELAY_POLL_INTERVAL": "soon"}},
		"bad crash point":  {nil, map[string]string{"CRASH_POINT": "nowhere"}},
		"bad database URL": {nil, map[string]string{"DATABASE_URL": "postgres://[::1"}},
		"bad MIGRATE":      {nil, map[string]string{"MIGRATE": "maybe"}},
	} {
		t.Run(name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), tc.args, func(k string) string { return tc.env[k] }, &out, &out)
			if err == nil {
				t.Fatal("run succeeded")
			}
		})
	}
}

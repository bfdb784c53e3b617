package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"testing"
)

// Two figures may ask for the same purpose (e2e_latency and e2e_latency_wal
// both run a "wake" variant): each gets a vhost of its own and the run's
// cleanup deletes each once. Before, both used one vhost and the second
// delete failed the whole run after its table was printed.
func TestSamePurposeGetsResourcesOfItsOwn(t *testing.T) {
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("rabbitmqctl not found: %v", err)
		}
		t.Skipf("rabbitmqctl not found (needed to create vhosts): %v", err)
	}
	amqpURL := os.Getenv("TEST_AMQP_URL")
	if amqpURL == "" {
		amqpURL = "amqp://guest:guest@127.0.0.1:5672/"
	}
	e := newEnv("", amqpURL, "", slog.New(slog.NewTextHandler(io.Discard, nil)))
	ctx := context.Background()
	first, err := e.newVhost(ctx, "e2e-wake")
	if err != nil {
		t.Fatal(err)
	}
	second, err := e.newVhost(ctx, "e2e-wake")
	if err != nil {
		t.Fatal(err)
	}
	if first == second {
		t.Errorf("both figures got the broker URL %s", first)
	}
	if err := e.close(); err != nil {
		t.Errorf("close: %v", err)
	}
}

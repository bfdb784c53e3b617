package main

import (
	"bufio"
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"go.mongodb.org/mongo-driver/v2/mongo"
	"go.mongodb.org/mongo-driver/v2/mongo/options"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The server answers with its URI, serves until its input ends, then stops.
func TestServesUntilItsInputEnds(t *testing.T) {
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(t.Context(), []string{"standalone"}, inR, outW)
		_ = outW.Close()
	}()
	sc := bufio.NewScanner(outR)
	if !sc.Scan() {
		t.Fatalf("no answer: %v", sc.Err())
	}
	uri, ok := strings.CutPrefix(sc.Text(), "uri=")
	if !ok {
		t.Fatalf("answer %q, want uri=...", sc.Text())
	}
	go func() { _, _ = io.Copy(io.Discard, outR) }()
	client, err := mongo.Connect(options.Client().ApplyURI(uri).SetServerSelectionTimeout(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Ping(t.Context(), nil); err != nil {
		t.Fatalf("ping %s: %v", uri, err)
	}
	_ = client.Disconnect(context.Background())
	_ = inW.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("still serving a minute after its input ended")
	}
}

func TestRefusesAnUnknownServer(t *testing.T) {
	if err := run(t.Context(), []string{"sharded"}, strings.NewReader(""), io.Discard); err == nil {
		t.Fatal("run(sharded) succeeded")
	}
}

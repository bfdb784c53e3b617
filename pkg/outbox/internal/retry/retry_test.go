package retry

import (
	"context"
	"testing"
	"time"
)

func TestBackoffDoublesUpToTheLimit(t *testing.T) {
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 7: 60 * time.Second, 100: 60 * time.Second} {
		if got := Backoff(n, time.Second, time.Minute); got != want {
			t.Errorf("Backoff(%d) = %v, want %v", n, got, want)
		}
	}
}

func TestJitterStaysWithinHalfAndWhole(t *testing.T) {
	for range 1000 {
		if got := Jitter(time.Second); got < time.Second/2 || got > time.Second {
			t.Fatalf("Jitter(1s) = %v, outside [0.5s, 1s]", got)
		}
	}
	if got := Jitter(1); got != 1 {
		t.Errorf("Jitter(1) = %v", got)
	}
}

func TestSleepEndsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan struct{})
	go func() { Sleep(ctx, time.Hour); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Sleep did not end with its context")
	}
}

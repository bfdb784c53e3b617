// Package retry holds the waiting rules shared by the relay, the WAL relay
// and the publishers' redialling: exponential backoff, jitter, and a sleep that
// ends with its context.
package retry

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"
)

// Backoff is base * 2^(n-1), capped at limit.
func Backoff(n int, base, limit time.Duration) time.Duration {
	d := base
	for i := 1; i < n && d < limit; i++ {
		d *= 2
	}
	return min(d, limit)
}

// Jitter spreads d uniformly over [d/2, d], so relays and rows that failed
// together do not retry together.
func Jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// Sleep waits d or until ctx ends.
func Sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// ErrStopped is what SleepOrStop returns when stop closed first.
var ErrStopped = errors.New("retry: stopped")

// SleepOrStop waits d; it returns ctx.Err() if ctx ends first and
// ErrStopped if stop is closed first.
func SleepOrStop(ctx context.Context, d time.Duration, stop <-chan struct{}) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-stop:
		return ErrStopped
	case <-t.C:
		return nil
	}
}

package audit

import (
	"context"
	"errors"
	"iter"
	"testing"
)

// count yields 1..n, then err if not nil; ended is closed when it returns,
// and gotCancel says whether its context was cancelled by then.
func count(n int, err error, ended chan struct{}, gotCancel *bool) func(context.Context) iter.Seq2[int, error] {
	return func(ctx context.Context) iter.Seq2[int, error] {
		return func(yield func(int, error) bool) {
			defer close(ended)
			for i := 1; i <= n; i++ {
				if !yield(i, nil) {
					*gotCancel = ctx.Err() != nil
					return
				}
			}
			if err != nil {
				yield(0, err)
			}
		}
	}
}

// A stream read ahead yields every item in order, then its error; stopped
// early, its reader's context is cancelled and its goroutine ends.
func TestPrefetch(t *testing.T) {
	boom := errors.New("boom")
	ended := make(chan struct{})
	var cancelled bool
	next, stop := prefetch(t.Context(), count(2500, boom, ended, &cancelled), 1000, 2)
	for want := 1; want <= 2500; want++ {
		v, err, ok := next()
		if !ok || err != nil || v != want {
			t.Fatalf("item %d: %d, %v, %v", want, v, err, ok)
		}
	}
	if _, err, ok := next(); ok || !errors.Is(err, boom) {
		t.Fatalf("after the items: %v, %v; want the stream's error", err, ok)
	}
	if _, err, ok := next(); ok || err != nil {
		t.Fatalf("after the error: %v, %v; want the end", err, ok)
	}
	stop()
	<-ended

	ended = make(chan struct{})
	next, stop = prefetch(t.Context(), count(1_000_000, nil, ended, &cancelled), 100, 2)
	if v, err, ok := next(); v != 1 || err != nil || !ok {
		t.Fatalf("first item: %d, %v, %v", v, err, ok)
	}
	stop()
	<-ended // the reader returned: no goroutine left behind
	if !cancelled {
		t.Fatal("the reader stopped without its context cancelled")
	}
}

package audit

import (
	"context"
	"iter"
	"sync"
)

// prefetched is one batch a reader goroutine read ahead: its items, and the
// error the stream ended with after them, if any.
type prefetched[T any] struct {
	items []T
	err   error
}

// prefetch reads the stream open returns in a goroutine of its own, in
// batches of batch items, at most depth batches ahead of its consumer, so
// that the stream's reads (a database's round trips, its server's work)
// overlap the consumer's. Memory holds at most depth+2 batches. next returns
// the items in order (ok false at the end, or with the stream's error);
// stop ends the goroutine and waits for it. open gets a context that stop
// cancels.
func prefetch[T any](ctx context.Context, open func(context.Context) iter.Seq2[T, error], batch, depth int) (next func() (T, error, bool), stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	ch := make(chan prefetched[T], depth)
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(ch)
		send := func(p prefetched[T]) bool {
			select {
			case ch <- p:
				return true
			case <-ctx.Done():
				return false
			}
		}
		items := make([]T, 0, batch)
		for v, err := range open(ctx) {
			if err != nil {
				send(prefetched[T]{items: items, err: err})
				return
			}
			items = append(items, v)
			if len(items) == batch {
				if !send(prefetched[T]{items: items}) {
					return
				}
				items = make([]T, 0, batch)
			}
		}
		if len(items) > 0 {
			send(prefetched[T]{items: items})
		}
	})
	var (
		cur  prefetched[T]
		i    int
		done bool
	)
	next = func() (T, error, bool) {
		var zero T
		for !done && i == len(cur.items) {
			if cur.err != nil {
				done = true
				return zero, cur.err, false
			}
			p, ok := <-ch
			if !ok {
				done = true
				break
			}
			cur, i = p, 0
		}
		if done {
			return zero, nil, false
		}
		v := cur.items[i]
		i++
		return v, nil, true
	}
	stop = func() {
		cancel()
		for range ch { // unblock a send in flight
		}
		wg.Wait()
	}
	return next, stop
}

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// fakeOrders is a stand-in for the orders API that checks each request's
// shape the way the real one does and records what it saw.
type fakeOrders struct {
	t *testing.T

	mu        sync.Mutex
	keys      map[string]int
	cancels   int
	failEvery int // answer 500 to every failEvery-th create; 0: never
	creates   int
	seen      chan struct{} // receives after each create, if there is room
}

func (f *fakeOrders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "method", http.StatusMethodNotAllowed)
		return
	}
	switch {
	case r.URL.Path == "/orders":
		if ct := r.Header.Get("Content-Type"); ct != "application/json" {
			http.Error(w, "content type "+ct, http.StatusUnsupportedMediaType)
			return
		}
		dec := json.NewDecoder(r.Body)
		dec.DisallowUnknownFields()
		var o newOrder
		if err := dec.Decode(&o); err != nil || o.CustomerID == "" || o.Currency != "EUR" || len(o.Items) == 0 ||
			o.Items[0].Quantity < 1 || o.Items[0].UnitPrice < 1 {
			http.Error(w, fmt.Sprintf("bad body %+v: %v", o, err), http.StatusUnprocessableEntity)
			return
		}
		f.mu.Lock()
		key := r.Header.Get("Idempotency-Key")
		f.keys[key]++
		f.creates++
		n := f.creates
		f.mu.Unlock()
		select {
		case f.seen <- struct{}{}:
		default: // nobody is counting, or the buffer is full
		}
		if f.failEvery > 0 && n%f.failEvery == 0 {
			http.Error(w, `{"error":"boom"}`, http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"id":"order-%d","status":"created"}`, n)
	case strings.HasPrefix(r.URL.Path, "/orders/order-") && strings.HasSuffix(r.URL.Path, "/cancel"):
		f.mu.Lock()
		f.cancels++
		f.mu.Unlock()
		_, _ = io.WriteString(w, `{"id":"x","status":"cancelled"}`)
	default:
		http.NotFound(w, r)
	}
}

func newFake(t *testing.T) (*fakeOrders, string) {
	t.Helper()
	f := &fakeOrders{t: t, keys: map[string]int{}}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	return f, srv.URL
}

func TestRunPlacesExactlyNOrdersWithDistinctKeys(t *testing.T) {
	t.Parallel()
	f, url := newFake(t)
	var out bytes.Buffer
	err := run(t.Context(), []string{"-url", url, "-n", "60", "-rate", "2000", "-cancel", "0.5", "-report", "0"}, &out, io.Discard)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.creates != 60 || len(f.keys) != 60 {
		t.Fatalf("creates = %d with %d distinct keys, want 60 and 60", f.creates, len(f.keys))
	}
	for k, n := range f.keys {
		if !strings.HasPrefix(k, "loadgen-") || n != 1 {
			t.Fatalf("key %q used %d times", k, n)
		}
	}
	if f.cancels == 0 || f.cancels == 60 {
		t.Fatalf("cancels = %d, want some but not all of 60 with -cancel 0.5", f.cancels)
	}
	want := fmt.Sprintf("60 orders created, %d cancelled, 0 failed requests", f.cancels)
	if !strings.Contains(out.String(), want) {
		t.Fatalf("summary %q does not contain %q", out.String(), want)
	}
}

func TestRunReportsFailedRequests(t *testing.T) {
	t.Parallel()
	f, url := newFake(t)
	f.failEvery = 4
	var out bytes.Buffer
	err := run(t.Context(), []string{"-url", url, "-n", "20", "-rate", "2000", "-cancel", "0", "-report", "0"}, &out, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "5 requests failed") || !strings.Contains(err.Error(), "500 Internal Server Error") {
		t.Fatalf("run = %v, want 5 failed requests with the status in the error", err)
	}
	if !strings.Contains(out.String(), "15 orders created, 0 cancelled, 5 failed requests") {
		t.Fatalf("summary: %q", out.String())
	}
}

// An interrupt stops the load promptly; requests already in flight complete
// and are not counted as failures.
func TestRunStopsOnInterrupt(t *testing.T) {
	t.Parallel()
	f, url := newFake(t)
	f.seen = make(chan struct{}, 1000)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	var out bytes.Buffer
	go func() {
		done <- run(ctx, []string{"-url", url, "-rate", "1000", "-duration", "1h", "-report", "0"}, &out, io.Discard)
	}()
	for range 10 {
		<-f.seen
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run after interrupt: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return within 10s of the interrupt")
	}
	if !strings.Contains(out.String(), "0 failed requests") {
		t.Fatalf("summary: %q", out.String())
	}
}

func TestFlagsRejectBadValues(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"-url", "localhost:8080"}, "-url"},
		{[]string{"-url", "ftp://x"}, "-url"},
		{[]string{"-rate", "0"}, "-rate"},
		{[]string{"-rate", "NaN"}, "-rate"},
		{[]string{"-n", "-1"}, "-n"},
		{[]string{"-duration", "0s"}, "-duration"},
		{[]string{"-cancel", "1.5"}, "-cancel"},
		{[]string{"-workers", "0"}, "-workers"},
		{[]string{"-report", "-1s"}, "-report"},
		{[]string{"-timeout", "0s"}, "-timeout"},
		{[]string{"extra"}, "unexpected arguments"},
	}
	for _, tt := range tests {
		_, err := parseFlags(tt.args, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("parseFlags(%q) = %v, want an error naming %q", tt.args, err, tt.want)
		}
	}
	if _, err := parseFlags(nil, io.Discard); err != nil {
		t.Errorf("defaults rejected: %v", err)
	}
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

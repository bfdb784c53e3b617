package chaos

import (
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

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeOrders is an orders API that keeps orders in memory, honours
// Idempotency-Key, and misbehaves on purpose: it answers some requests with a
// 503 before doing anything, commits some and then drops the connection (the
// client cannot know), and answers the rest.
type fakeOrders struct {
	mu       sync.Mutex
	n        int
	byKey    map[string]string // key -> order id
	status   map[string]string // order id -> status
	version  map[string]int64  // order id -> version
	amended  map[string]int64  // order id + "/" + amendment key -> version
	requests int
}

func newFakeOrders() *fakeOrders {
	return &fakeOrders{byKey: map[string]string{}, status: map[string]string{}, version: map[string]int64{}, amended: map[string]int64{}}
}

func (f *fakeOrders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests++
	mode := f.requests % 3 // 0: 503 before commit, 1: commit then drop, 2: answer
	if mode == 0 {
		http.Error(w, `{"error":{"code":"unavailable"}}`, http.StatusServiceUnavailable)
		return
	}
	var id string
	code := http.StatusOK
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/orders":
		var body createBody
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.CustomerID != r.Header.Get("Idempotency-Key") {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		key := r.Header.Get("Idempotency-Key")
		if id = f.byKey[key]; id == "" {
			f.n++
			id = fmt.Sprintf("order-%d", f.n)
			f.byKey[key], f.status[id], f.version[id] = id, StatusCreated, 1
		}
		code = http.StatusCreated
	case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/amendments"):
		id = strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/orders/"), "/amendments")
		var body struct{ Note string }
		key := r.Header.Get("Idempotency-Key")
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil || key == "" || !strings.HasPrefix(body.Note, key+": ") {
			http.Error(w, "bad amendment", http.StatusBadRequest)
			return
		}
		if f.status[id] != StatusCreated {
			http.Error(w, "not amendable", http.StatusConflict)
			return
		}
		v, done := f.amended[id+"/"+key]
		if !done {
			f.version[id]++
			v = f.version[id]
			f.amended[id+"/"+key] = v
		}
		if mode == 1 {
			panic(http.ErrAbortHandler)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"order_id": id, "version": v, "note": body.Note})
		return
	case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/cancel"):
		id = strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/orders/"), "/cancel")
		if f.status[id] == "" {
			http.Error(w, "not found", http.StatusNotFound)
			return
		}
		if f.status[id] != StatusCancelled {
			f.version[id]++
		}
		f.status[id] = StatusCancelled
	default:
		http.Error(w, "no route", http.StatusNotFound)
		return
	}
	if mode == 1 {
		panic(http.ErrAbortHandler) // committed, but the client sees the connection drop
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]string{"id": id, "status": f.status[id]})
}

func TestWorkloadRetriesUntilAcknowledged(t *testing.T) {
	fake := newFakeOrders()
	srv := httptest.NewServer(fake)
	defer srv.Close()

	var rec Recorder
	w, err := NewWorkload(WorkloadConfig{
		BaseURL: srv.URL, Recorder: &rec, KeyPrefix: "t", Clients: 3, Rate: 200, CancelRatio: 1, Seed: 1,
		AttemptTimeout: time.Second, OpTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	if err := w.Run(ctx); err != nil {
		t.Fatal(err)
	}

	h := rec.History()
	fake.mu.Lock()
	defer fake.mu.Unlock()
	var creates, cancels, retried int
	for _, op := range h.Ops {
		if op.Outcome != OutcomeOK {
			t.Errorf("%+v: want ok, the fake answers every third attempt", op)
			continue
		}
		if op.Attempts > 1 {
			retried++
		}
		switch op.Kind {
		case OpCreate:
			creates++
			if fake.byKey[op.Key] != op.OrderID {
				t.Errorf("create %s acknowledged as %s, the server holds %q", op.Key, op.OrderID, fake.byKey[op.Key])
			}
		case OpCancel:
			cancels++
			if fake.status[op.OrderID] != StatusCancelled {
				t.Errorf("cancel of %s acknowledged, the server has it %q", op.OrderID, fake.status[op.OrderID])
			}
		}
	}
	if creates < 5 || cancels == 0 || retried == 0 {
		t.Errorf("got %d creates, %d cancels, %d retried; want several of each", creates, cancels, retried)
	}
	if len(fake.byKey) != creates {
		t.Errorf("server holds %d orders for %d acknowledged creates: a retry made a second order", len(fake.byKey), creates)
	}
}

// Amended orders get AmendMin to AmendMax amendments, each acknowledged
// with its order's next version, before any cancel; retries of an
// amendment make no second version.
func TestWorkloadDrivesChains(t *testing.T) {
	fake := newFakeOrders()
	srv := httptest.NewServer(fake)
	defer srv.Close()

	var rec Recorder
	w, err := NewWorkload(WorkloadConfig{
		BaseURL: srv.URL, Recorder: &rec, KeyPrefix: "t", Clients: 2, Rate: 100, CancelRatio: 0.5, Seed: 3,
		AmendRatio: 1, AmendMin: 4, AmendMax: 18, AttemptTimeout: time.Second, OpTimeout: 10 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	// The run stops on what it has seen, not after a fixed time: under a
	// loaded race-enabled build an 800 ms run saw two orders.
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	go func() {
		for ctx.Err() == nil {
			if enoughChains(rec.History()) {
				cancel()
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	if err := w.Run(ctx); err != nil {
		t.Fatal(err)
	}

	h := rec.History()
	fake.mu.Lock()
	defer fake.mu.Unlock()
	amends := make(map[string][]Op)
	cancelled := make(map[string]bool)
	for _, op := range h.Ops {
		if op.Outcome != OutcomeOK {
			t.Errorf("%+v: want ok", op)
			continue
		}
		switch op.Kind {
		case OpAmend:
			if cancelled[op.OrderID] {
				t.Errorf("amendment %s sent after its order's cancel", op.Key)
			}
			if want := fake.amended[op.OrderID+"/"+op.Key]; op.Version != want || want == 0 {
				t.Errorf("amendment %s acknowledged as v%d, the server made v%d", op.Key, op.Version, want)
			}
			amends[op.OrderID] = append(amends[op.OrderID], op)
		case OpCancel:
			cancelled[op.OrderID] = true
		}
	}
	lengths := make(map[int]bool)
	for id, ops := range amends {
		if len(ops) < 4 || len(ops) > 18 {
			t.Errorf("order %s got %d amendments, want 4 to 18", id, len(ops))
		}
		for i, op := range ops {
			if op.Version != int64(i+2) {
				t.Errorf("order %s: amendment %d is v%d, want v%d", id, i, op.Version, i+2)
			}
		}
		lengths[len(ops)] = true
	}
	if len(amends) < 3 || len(lengths) < 2 || len(cancelled) == 0 {
		t.Errorf("%d orders amended with %d distinct lengths, %d cancelled; want several of each", len(amends), len(lengths), len(cancelled))
	}
	if n := len(fake.amended); n != len(h.Ops)-len(fake.byKey)-len(cancelled) {
		t.Errorf("server holds %d amendments for %d acknowledged: a retry made a second version", n, len(h.Ops)-len(fake.byKey)-len(cancelled))
	}
}

// enoughChains says whether h holds at least 4 orders with amendments and
// a cancel, enough for two chain lengths to be likely once they finish.
func enoughChains(h History) bool {
	amended := make(map[string]bool)
	cancels := 0
	for _, op := range h.Ops {
		switch op.Kind {
		case OpAmend:
			amended[op.OrderID] = true
		case OpCancel:
			cancels++
		}
	}
	return len(amended) >= 5 && cancels > 0
}

func TestWorkloadOutcomes(t *testing.T) {
	tests := []struct {
		name    string
		handler http.HandlerFunc
		want    Outcome
	}{
		{"refused", func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":{"code":"invalid_field"}}`, http.StatusUnprocessableEntity)
		}, OutcomeFailed},
		{"always unavailable", func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "down", http.StatusServiceUnavailable)
		}, OutcomeUnknown},
		{"too many requests", func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "slow down", http.StatusTooManyRequests)
		}, OutcomeUnknown},
		{"created without an id", func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{}`))
		}, OutcomeUnknown},
		{"hangs", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body) // so the server notices the client hanging up
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		}, OutcomeUnknown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(tt.handler)
			defer srv.Close()
			var rec Recorder
			w, err := NewWorkload(WorkloadConfig{
				BaseURL: srv.URL, Recorder: &rec, KeyPrefix: "t", Clients: 1, Rate: 20,
				AttemptTimeout: 50 * time.Millisecond, OpTimeout: 300 * time.Millisecond,
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			_ = w.Run(ctx)
			h := rec.History()
			if len(h.Ops) == 0 {
				t.Fatal("no operation recorded")
			}
			for _, op := range h.Ops {
				if op.Outcome != tt.want || op.Kind != OpCreate || op.End.Before(op.Start) {
					t.Errorf("%+v: want a create with outcome %s", op, tt.want)
				}
				if tt.want == OutcomeUnknown && op.Attempts < 2 {
					t.Errorf("%+v: gave up without retrying", op)
				}
			}
		})
	}
}

func TestNewWorkloadRejectsBadConfig(t *testing.T) {
	var rec Recorder
	ok := WorkloadConfig{BaseURL: "http://127.0.0.1:1", Recorder: &rec, KeyPrefix: "run-1"}
	tests := []struct {
		name   string
		change func(*WorkloadConfig)
	}{
		{"no URL", func(c *WorkloadConfig) { c.BaseURL = "" }},
		{"not http", func(c *WorkloadConfig) { c.BaseURL = "ftp://x" }},
		{"no recorder", func(c *WorkloadConfig) { c.Recorder = nil }},
		{"no prefix", func(c *WorkloadConfig) { c.KeyPrefix = "" }},
		{"prefix with a space", func(c *WorkloadConfig) { c.KeyPrefix = "a b" }},
		{"prefix too long", func(c *WorkloadConfig) { c.KeyPrefix = strings.Repeat("k", 65) }},
		{"negative clients", func(c *WorkloadConfig) { c.Clients = -1 }},
		{"cancel ratio above one", func(c *WorkloadConfig) { c.CancelRatio = 1.5 }},
		{"amend ratio above one", func(c *WorkloadConfig) { c.AmendRatio = 2 }},
		{"amend max below min", func(c *WorkloadConfig) { c.AmendMin, c.AmendMax = 5, 3 }},
		{"op timeout below attempt timeout", func(c *WorkloadConfig) { c.AttemptTimeout, c.OpTimeout = time.Second, time.Millisecond }},
	}
	if _, err := NewWorkload(ok); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := ok
			tt.change(&cfg)
			if _, err := NewWorkload(cfg); err == nil || !strings.HasPrefix(err.Error(), "workload: ") {
				t.Errorf("err = %v, want a workload: error", err)
			}
		})
	}
}

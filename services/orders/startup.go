package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// The long-running commands (serve, and relay with HTTP_ADDR) listen on
// HTTP_ADDR before they wait for the database, and answer there while they
// wait: /healthz 200, the process being alive and doing what it should,
// and /readyz 503 with what it waits for. A liveness probe that got no
// answer would kill a process that only waits, and put it into the
// orchestrator's restart backoff the wait is there to avoid. Once the
// database answered, the command's own endpoints take over.

// startupStatus is how far a command's start has come: the failed attempts
// to open the database and the last one's error, or that the database was
// reached. awaitDatabase writes it, the start-up /readyz reads it.
type startupStatus struct {
	mu       sync.Mutex
	since    time.Time
	attempts int   // failed attempts
	lastErr  error // the last failed attempt's error
	reached  bool
}

func newStartupStatus() *startupStatus { return &startupStatus{since: time.Now()} }

func (s *startupStatus) failed(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.attempts++
	s.lastErr = err
}

func (s *startupStatus) succeeded() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reached = true
}

// waiting returns the failed attempts so far, the last one's error (nil
// before the first has ended), how long the wait has lasted, and whether
// the database was reached.
func (s *startupStatus) waiting() (attempts int, lastErr error, waited time.Duration, reached bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.attempts, s.lastErr, time.Since(s.since), s.reached
}

// startupBody is the JSON body of the start-up /readyz.
type startupBody struct {
	Status string `json:"status"` // "starting"
	Reason string `json:"reason"`
	// Database is the last failed attempt's error; absent before one ended.
	Database string `json:"database,omitempty"`
	Attempts int    `json:"attempts,omitempty"`
	Waited   string `json:"waited,omitempty"`
}

// startupHandler serves a command's HTTP endpoints until its own take over:
// /healthz 200, /readyz 503 with a startupBody, everything else 503.
func startupHandler(st *startupStatus) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeStartupJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		writeStartupJSON(w, http.StatusServiceUnavailable, startupReadiness(st))
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		b := startupReadiness(st)
		// The API's error body (internal/httpapi).
		writeStartupJSON(w, http.StatusServiceUnavailable, map[string]map[string]string{
			"error": {"code": "starting", "message": "the service is starting: " + b.Reason},
		})
	})
	return mux
}

func startupReadiness(st *startupStatus) startupBody {
	attempts, lastErr, waited, reached := st.waiting()
	if reached {
		return startupBody{Status: "starting", Reason: "database reached, starting"}
	}
	b := startupBody{Status: "starting", Reason: "waiting for the database", Attempts: attempts, Waited: waited.Round(time.Millisecond).String()}
	if lastErr != nil {
		b.Database = lastErr.Error()
	}
	return b
}

func writeStartupJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// httpServer is a command's HTTP server, serving from the command's start:
// first a start-up handler, then, once the command is ready to serve, its
// own (Handle).
type httpServer struct {
	handler atomic.Pointer[http.Handler]
	stop    context.CancelFunc
	stopped chan struct{}
	err     error // serveHTTP's, set before stopped is closed
}

// startHTTP listens on addr and serves h there until ctx ends or Close.
func startHTTP(ctx context.Context, addr string, h http.Handler, logger *slog.Logger) (*httpServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	ctx, stop := context.WithCancel(ctx)
	s := &httpServer{stop: stop, stopped: make(chan struct{})}
	s.Handle(h)
	go func() {
		defer close(s.stopped)
		s.err = serveHTTP(ctx, ln, s, logger)
	}()
	return s, nil
}

// Handle makes h answer every request from now on.
func (s *httpServer) Handle(h http.Handler) { s.handler.Store(&h) }

func (s *httpServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	(*s.handler.Load()).ServeHTTP(w, r)
}

// Run returns when ctx ends, once the requests in flight are done, or when
// the server fails.
func (s *httpServer) Run(ctx context.Context) error {
	select {
	case <-ctx.Done():
	case <-s.stopped:
	}
	return s.Close()
}

// Close stops the server, waits for the requests in flight, and returns
// its error. It may be called more than once.
func (s *httpServer) Close() error {
	s.stop()
	<-s.stopped
	return s.err
}

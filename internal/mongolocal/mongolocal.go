// Package mongolocal runs an embedded FerretDB (MongoDB wire protocol over
// SQLite) inside the current process, for local runs and tests on machines
// without a MongoDB server.
//
// FerretDB with the SQLite backend speaks enough of MongoDB for the inbox and
// the shipping service: unique indexes, duplicate-key errors (code 11000),
// upserts, findOneAndUpdate. It has no transactions and no TTL indexes, so it
// behaves like a standalone server without those features; pkg/inbox detects
// that and uses its standalone protocol.
//
// Two more differences matter to code written against it, and are why the
// inbox and the shipment store select by _id alone and rely on unique _id
// inserts for exclusion:
//   - updates are read-modify-write without isolation: two concurrent
//     conditional updates of one document can both apply, or one can undo
//     the other (a lost update); inserts with a duplicate _id do fail;
//   - only a filter that is exactly {_id: <string or ObjectID>} is pushed
//     down to SQLite, and every other filter scans the collection. Even
//     that one scans in FerretDB as released (its _id index does not match
//     its own query's expression); this server adds an index that does,
//     see Config.IDIndexInterval.
//
// Under the race detector the embedded server is about ten times slower than
// in a normal build; a test suite can share one server started with
// `go run ./cmd/mongolocal` through TEST_MONGO_URI (see package mongotest).
//
// FerretDB logs every failed command at WARN, and duplicate-key errors are the
// inbox's normal path: Start hands it a logger that only lets ERROR through.
package mongolocal

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/FerretDB/FerretDB/ferretdb"
)

// Config configures an embedded server.
type Config struct {
	// Addr is the TCP address to listen on. Default: "127.0.0.1:0", a free
	// port on the loopback interface (read it back with Server.Addr).
	Addr string
	// DataDir holds the SQLite files, one per database; it is created if
	// missing and kept on Close. Default: a new temporary directory, removed
	// on Close.
	DataDir string
	// Logger receives FerretDB's own logs at ERROR level and above.
	// Default: discard.
	Logger *slog.Logger
	// IDIndexInterval is how often the server looks for new collections to
	// give the _id index FerretDB's lookups can use (see idindex.go): a new
	// collection's finds, updates and deletes by _id scan it until then.
	// Negative: never, FerretDB as released. Default: 100ms.
	IDIndexInterval time.Duration
}

// newMu serialises ferretdb.New, which writes a package-level version record
// of FerretDB's.
var newMu sync.Mutex

// Server is a running embedded FerretDB.
type Server struct {
	addr    string
	uri     string
	dataDir string
	tempDir bool

	cancel context.CancelFunc
	done   chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// Start listens on cfg.Addr and serves until ctx is cancelled or Close is
// called. The listener is bound when Start returns, so URI is usable at once.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("mongolocal: start: %w", err)
	}
	addr := cmp.Or(cfg.Addr, "127.0.0.1:0")
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("mongolocal: Addr %q: %w", addr, err)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}

	s := &Server{dataDir: cfg.DataDir, done: make(chan struct{})}
	if s.dataDir == "" {
		dir, err := os.MkdirTemp("", "mongolocal-")
		if err != nil {
			return nil, fmt.Errorf("mongolocal: create data dir: %w", err)
		}
		s.dataDir, s.tempDir = dir, true
	} else {
		abs, err := filepath.Abs(s.dataDir)
		if err != nil {
			return nil, fmt.Errorf("mongolocal: DataDir %q: %w", s.dataDir, err)
		}
		if err := os.MkdirAll(abs, 0o750); err != nil {
			return nil, fmt.Errorf("mongolocal: create data dir: %w", err)
		}
		s.dataDir = abs
	}

	// ferretdb.New does not close its SQLite backend when its listener fails,
	// and the leaked backend panics the process when the GC finalizes it, so
	// the address is bound (and a free port picked) here first.
	addr, err := reserve(addr)
	if err != nil {
		_ = s.removeTemp()
		return nil, fmt.Errorf("mongolocal: listen on %s: %w", cmp.Or(cfg.Addr, "127.0.0.1:0"), err)
	}

	newMu.Lock()
	f, err := ferretdb.New(&ferretdb.Config{
		Listener:  ferretdb.ListenerConfig{TCP: addr},
		Logger:    slog.New(minLevel{min: slog.LevelError, h: logger.Handler()}),
		Handler:   "sqlite",
		SQLiteURL: "file:" + filepath.ToSlash(s.dataDir) + "/",
	})
	newMu.Unlock()
	if err != nil {
		_ = s.removeTemp()
		return nil, fmt.Errorf("mongolocal: start FerretDB on %s: %w", addr, err)
	}
	s.uri = f.MongoDBURI()
	u, err := url.Parse(s.uri)
	if err != nil {
		_ = s.removeTemp()
		return nil, fmt.Errorf("mongolocal: parse FerretDB URI %q: %w", s.uri, err)
	}
	s.addr = u.Host

	// The server's lifetime is its own, bounded by ctx and by Close.
	runCtx, cancel := context.WithCancel(ctx)
	s.cancel = cancel
	var wg sync.WaitGroup
	if interval := cmp.Or(cfg.IDIndexInterval, 100*time.Millisecond); interval > 0 {
		wg.Go(func() { runIDIndexer(runCtx, s.dataDir, interval, logger) })
	}
	wg.Go(func() { _ = f.Run(runCtx) }) // always nil
	go func() {
		wg.Wait()
		close(s.done)
	}()
	return s, nil
}

// URI is the server's connection string, e.g. "mongodb://127.0.0.1:41234/".
func (s *Server) URI() string { return s.uri }

// Addr is the address the server listens on, e.g. "127.0.0.1:41234".
func (s *Server) Addr() string { return s.addr }

// DataDir is the directory holding the server's SQLite files.
func (s *Server) DataDir() string { return s.dataDir }

// Done is closed once the server has stopped (after its context ended or
// Close was called).
func (s *Server) Done() <-chan struct{} { return s.done }

// Close stops the server and waits until it has stopped. FerretDB gives
// connected clients up to three seconds to disconnect, so disconnect clients
// first for a fast stop. A temporary data directory is then removed. Close is
// safe to call more than once.
func (s *Server) Close() error {
	s.cancel()
	<-s.done
	s.closeOnce.Do(func() { s.closeErr = s.removeTemp() })
	return s.closeErr
}

// Stop is Close bounded by ctx: if the server has not stopped when ctx ends,
// Stop returns ctx's error and the server finishes stopping on its own.
func (s *Server) Stop(ctx context.Context) error {
	s.cancel()
	select {
	case <-s.done:
		return s.Close()
	case <-ctx.Done():
		return fmt.Errorf("mongolocal: stop: %w", ctx.Err())
	}
}

func (s *Server) removeTemp() error {
	if !s.tempDir {
		return nil
	}
	if err := os.RemoveAll(s.dataDir); err != nil {
		return fmt.Errorf("mongolocal: remove data dir: %w", err)
	}
	return nil
}

// reserve checks that addr can be bound and returns it with a concrete
// port (a free one when addr's port is 0). The port is released before
// FerretDB binds it; another process could take it in between, which is
// the small risk of a port-0 address.
func reserve(addr string) (string, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	bound := l.Addr().String()
	if err := l.Close(); err != nil {
		return "", err
	}
	return bound, nil
}

// minLevel drops records below min before they reach h.
type minLevel struct {
	min slog.Level
	h   slog.Handler
}

var _ slog.Handler = minLevel{}

func (m minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= m.min && m.h.Enabled(ctx, l)
}

func (m minLevel) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < m.min {
		return nil
	}
	return m.h.Handle(ctx, r)
}

func (m minLevel) WithAttrs(attrs []slog.Attr) slog.Handler {
	return minLevel{min: m.min, h: m.h.WithAttrs(attrs)}
}

func (m minLevel) WithGroup(name string) slog.Handler {
	return minLevel{min: m.min, h: m.h.WithGroup(name)}
}
